// Spark's side of skiff's Carafe and RSort benches: GraphX PageRank and shortest paths, and a
// TeraSort-style sortByKey, each timed phase by phase.
//
// Not run by hand: bench/spark_peers.py compiles this file once with the Scala compiler that
// ships in pyspark's jars (cached by the source's hash) and runs it with pyspark's
// spark-submit in local mode. Arguments are a command then key=value pairs:
//
//   pagerank edges=PATH iterations=32 damping=0.85 partitions=N dangling=rescale|spread [out=PATH]
//   sssp     edges=PATH source=ID partitions=N algorithm=auto|shortestpaths|pregel [out=PATH]
//   sort     records=PATH out=PATH partitions=N mode=phased|pipelined
//
// Every command also takes warmup=N (small shuffle jobs run before timing starts; default 3).
// Progress goes to stderr; the figures go to stdout as one line `SKIFF_RESULT {json}`.
// Times are wall-clock seconds measured in the driver once the SparkContext is up and warmed
// up; the JVM's start, the context's and the timing's (epoch ms) are reported so the caller
// can tell start-up apart.

import java.io.{BufferedWriter, File, FileWriter, RandomAccessFile}
import java.lang.management.ManagementFactory
import java.nio.ByteBuffer
import java.util.concurrent.atomic.AtomicInteger

import org.apache.spark.{SparkConf, SparkContext}
import org.apache.spark.graphx._
import org.apache.spark.graphx.lib.{PageRank, ShortestPaths}
import org.apache.spark.rdd.RDD
import org.apache.spark.storage.StorageLevel

/** Unsigned lexicographic order of byte arrays: `LC_ALL=C sort`'s order of keys. */
object KeyOrdering extends Ordering[Array[Byte]] {
  def compare(a: Array[Byte], b: Array[Byte]): Int = java.util.Arrays.compareUnsigned(a, b)
}

/**
 * Counts GraphX Pregel's supersteps. Pregel returns no count, and the jobs it runs are no
 * measure of it (Spark 4's Pregel tests for messages with RDD.isEmpty, which runs one or two
 * jobs), but it logs "Pregel finished iteration i" at INFO after each superstep after the
 * first: this appender, on Pregel's logger alone and not passed on, counts those lines.
 */
object PregelCounter {
  import org.apache.logging.log4j.{Level, LogManager}
  import org.apache.logging.log4j.core.{LogEvent, LoggerContext}
  import org.apache.logging.log4j.core.appender.AbstractAppender
  import org.apache.logging.log4j.core.config.{LoggerConfig, Property}

  private val count = new AtomicInteger()
  private val LoggerName = "org.apache.spark.graphx.Pregel"

  def install(): Unit = {
    val ctx = LogManager.getContext(false).asInstanceOf[LoggerContext]
    val config = ctx.getConfiguration
    val appender = new AbstractAppender("skiff-pregel-counter", null, null, true, Property.EMPTY_ARRAY) {
      override def append(e: LogEvent): Unit =
        if (e.getMessage.getFormattedMessage.contains("finished iteration")) count.incrementAndGet()
    }
    appender.start()
    config.addAppender(appender)
    val logger = new LoggerConfig(LoggerName, Level.INFO, false)
    logger.addAppender(appender, Level.INFO, null)
    config.addLogger(LoggerName, logger)
    ctx.updateLoggers()
  }

  def iterations: Int = count.get()
}

object SkiffSpark {
  private def now(): Long = System.nanoTime()
  private def secs(t0: Long): Double = (System.nanoTime() - t0) / 1e9
  private def say(msg: String): Unit = System.err.println(s"[spark_graph] $msg")

  private def json(fields: Seq[(String, Any)]): String = fields.map { case (k, v) =>
    val value = v match {
      case null => "null"
      case s: String => "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"") + "\""
      case d: Double if d.isNaN || d.isInfinite => "null"
      case b: Boolean => b.toString
      case n => n.toString
    }
    "\"" + k + "\": " + value
  }.mkString("{", ", ", "}")

  def main(args: Array[String]): Unit = {
    val cmd = args(0)
    val opts = args.drop(1).map { a =>
      val i = a.indexOf('=')
      require(i > 0, s"expected key=value, got $a")
      a.substring(0, i) -> a.substring(i + 1)
    }.toMap
    def o(k: String, default: String): String = opts.getOrElse(k, default)
    val conf = new SparkConf().setAppName(s"skiff-$cmd")
      .set("spark.serializer", "org.apache.spark.serializer.KryoSerializer")
    if (cmd != "sort") GraphXUtils.registerKryoClasses(conf)
    val sc = new SparkContext(conf)
    val ready = System.currentTimeMillis()
    val jvmStart = ManagementFactory.getRuntimeMXBean.getStartTime
    say(s"Spark ${sc.version} ${sc.master}, context up ${ready - jvmStart} ms after JVM start")
    val fields = try {
      // Warm-up (warmup=N jobs, default 3): a small map + shuffle job run before anything is
      // timed, so that class loading and the first JIT compilations of Spark's scheduler, task
      // and shuffle paths count as start-up, not as the first phase. The last one's time is
      // about the floor of a Spark job here.
      val warm = now()
      var lastJobMs = 0.0
      for (_ <- 0 until o("warmup", "3").toInt) {
        val t = now()
        sc.parallelize(0 until 100000, sc.defaultParallelism).map(x => (x % 1000, 1L)).reduceByKey(_ + _).count()
        lastJobMs = (now() - t) / 1e6
      }
      val warmupS = secs(warm)
      if (warmupS > 0) say(f"warm-up $warmupS%.2f s, last job $lastJobMs%.0f ms")
      val started = System.currentTimeMillis()
      val result = cmd match {
        case "pagerank" => pagerank(sc, opts)
        case "sssp" => sssp(sc, opts)
        case "sort" => sort(sc, opts)
        case other => throw new IllegalArgumentException(s"unknown command $other")
      }
      Seq("spark_version" -> sc.version,
        "scala_version" -> scala.util.Properties.versionNumberString,
        "java_version" -> System.getProperty("java.version"),
        "master" -> sc.master,
        "jvm_start_epoch_ms" -> jvmStart,
        "context_ready_epoch_ms" -> ready,
        "timed_start_epoch_ms" -> started,
        "warmup_s" -> warmupS, "warmup_last_job_ms" -> lastJobMs) ++ result
    } finally {
      sc.stop()
    }
    println("SKIFF_RESULT " + json(fields))
  }

  /** The edge list as a graph, cached and materialised: (graph, edges, vertices, weighted). */
  private def load(sc: SparkContext, path: String, parts: Int): (Graph[Double, Double], Long, Long, Boolean) = {
    val weighted = sc.longAccumulator("weighted lines")
    // GraphLoader.edgeListFile's parse (split on whitespace, `#` comments), plus `%`
    // comments and an optional third column, the weight (1 when absent).
    val lines = sc.textFile(path, parts)
    val edges: RDD[Edge[Double]] = (if (lines.getNumPartitions > parts) lines.coalesce(parts) else lines)
      .mapPartitions { it =>
        it.flatMap { line =>
          val t = line.trim
          if (t.isEmpty || t.charAt(0) == '#' || t.charAt(0) == '%') Iterator.empty
          else {
            val f = t.split("\\s+")
            require(f.length >= 2, s"expected `src dst [weight]`: $line")
            val w = if (f.length >= 3) { weighted.add(1); f(2).toDouble } else 1.0
            Iterator.single(Edge(f(0).toLong, f(1).toLong, w))
          }
        }
      }
    val g = Graph.fromEdges(edges, 0.0, StorageLevel.MEMORY_ONLY, StorageLevel.MEMORY_ONLY)
    val ne = g.edges.count()
    val nv = g.vertices.count()
    (g, ne, nv, weighted.value > 0)
  }

  /** Writes `id<TAB>value` lines in id order (`inf` for unreached), as `skiff carafe --out`. */
  private def writeValues(values: RDD[(VertexId, Double)], out: String): Unit = {
    val all = values.collect().sortBy(_._1)
    val w = new BufferedWriter(new FileWriter(out), 1 << 20)
    try {
      for ((id, v) <- all) {
        w.write(id.toString); w.write('\t')
        w.write(if (v.isInfinite) "inf" else java.lang.Double.toString(v)); w.write('\n')
      }
    } finally w.close()
  }

  private def pagerank(sc: SparkContext, o: Map[String, String]): Seq[(String, Any)] = {
    val parts = o("partitions").toInt
    val iterations = o("iterations").toInt
    val damping = o("damping").toDouble
    val dangling = o.getOrElse("dangling", "rescale")
    var t = now()
    val (g, ne, nv, weighted) = load(sc, o("edges"), parts)
    val loadS = secs(t)
    say(f"loaded $nv%d vertices, $ne%d edges in $loadS%.2f s")
    t = now()
    val ranks: VertexRDD[Double] = dangling match {
      // GraphX's own static PageRank (lib.PageRank.run); ranks come back summing to N.
      case "rescale" => PageRank.run(g, iterations, 1.0 - damping).vertices
      case "spread" => spreadPageRank(g, nv, iterations, damping)
      case other => throw new IllegalArgumentException(s"dangling must be rescale or spread, not $other")
    }
    ranks.cache()
    ranks.count()
    val computeS = secs(t)
    say(f"$iterations%d iterations in $computeS%.2f s")
    val sum = ranks.values.sum()
    t = now()
    o.get("out").foreach(out => writeValues(ranks.mapValues(_ / sum), out))
    val writeS = secs(t)
    Seq("engine" -> "graphx",
      "algorithm" -> (if (dangling == "rescale") "org.apache.spark.graphx.lib.PageRank.run"
                      else "graphx aggregateMessages loop, dangling rank spread"),
      "dangling" -> dangling, "vertices" -> nv, "edges" -> ne, "weighted_input" -> weighted,
      "partitions" -> g.edges.getNumPartitions, "iterations" -> iterations, "damping" -> damping,
      "load_s" -> loadS, "compute_s" -> computeS, "per_superstep_s" -> computeS / iterations,
      "write_s" -> writeS, "total_s" -> (loadS + computeS + writeS),
      "rank_sum_before_normalising" -> sum)
  }

  /**
   * PageRank as Carafe, networkit and igraph have it, built from the same GraphX operators as
   * lib.PageRank.run (aggregateMessages along edges weighted 1/outdegree, outerJoinVertices,
   * one job per iteration that materialises the new graph): ranks start at 1/N and each
   * iteration computes (1-d)/N + d (incoming + dangling/N), with `dangling` the rank on
   * vertices without out-edges, summed by an accumulator as that job computes the ranks (a
   * fresh one each iteration; the ranks are cached, so each vertex adds once).
   */
  private def spreadPageRank(graph: Graph[Double, Double], n: Long, iterations: Int, d: Double): VertexRDD[Double] = {
    val sc = graph.vertices.sparkContext
    val nd = n.toDouble
    var g: Graph[(Double, Boolean), Double] = graph
      .outerJoinVertices(graph.outDegrees) { (_, _, deg) => deg.getOrElse(0) }
      .mapTriplets(e => 1.0 / e.srcAttr, TripletFields.Src)
      .mapVertices((_, deg) => (1.0 / nd, deg == 0))
      .cache()
    var dangling = g.vertices.map { case (_, (r, sink)) => if (sink) r else 0.0 }.sum()
    var i = 0
    while (i < iterations) {
      val incoming = g.aggregateMessages[Double](c => c.sendToDst(c.srcAttr._1 * c.attr), _ + _, TripletFields.Src)
      val base = (1.0 - d) / nd + d * dangling / nd
      val sinks = sc.doubleAccumulator(s"dangling rank $i")
      val prev = g
      g = g.outerJoinVertices(incoming) { (_, attr, in) =>
        val r = base + d * in.getOrElse(0.0)
        if (attr._2) sinks.add(r)
        (r, attr._2)
      }.cache()
      g.edges.foreachPartition(_ => ()) // materialises g's vertices too, as lib.PageRank does
      dangling = sinks.value
      prev.vertices.unpersist(false)
      prev.edges.unpersist(false)
      i += 1
    }
    g.vertices.mapValues(_._1)
  }

  private def sssp(sc: SparkContext, o: Map[String, String]): Seq[(String, Any)] = {
    val parts = o("partitions").toInt
    val source = o("source").toLong
    var t = now()
    val (g, ne, nv, weighted) = load(sc, o("edges"), parts)
    val loadS = secs(t)
    say(f"loaded $nv%d vertices, $ne%d edges${if (weighted) " (weighted)" else ""} in $loadS%.2f s")
    val algorithm = o.getOrElse("algorithm", "auto") match {
      case "auto" => if (weighted) "pregel" else "shortestpaths"
      case a @ ("pregel" | "shortestpaths") => a
      case other => throw new IllegalArgumentException(s"unknown algorithm $other")
    }
    val inf = Double.PositiveInfinity
    val counting = scala.util.Try(PregelCounter.install()).isSuccess
    t = now()
    val dist: VertexRDD[Double] = if (algorithm == "shortestpaths") {
      // lib.ShortestPaths gives each vertex its hop count TO the landmarks (messages go from
      // an edge's destination to its source), so the distances FROM the source are those of
      // the reversed graph.
      val sp = ShortestPaths.run(g.reverse, Seq(source))
      sp.vertices.mapValues(m => m.get(source).map(_.toDouble).getOrElse(inf))
    } else {
      // GraphX programming guide's single-source shortest paths, on the edge weights.
      val init = g.mapVertices((id, _) => if (id == source) 0.0 else inf)
      init.pregel(inf)(
        (_, dist, msg) => math.min(dist, msg),
        e => if (e.srcAttr + e.attr < e.dstAttr) Iterator((e.dstId, e.srcAttr + e.attr)) else Iterator.empty,
        (a, b) => math.min(a, b)).vertices
    }
    dist.cache()
    dist.count()
    val computeS = secs(t)
    // Superstep 0 (every vertex's program on the initial message, then the first messages)
    // plus one per logged iteration; the last one sent nothing.
    val supersteps = PregelCounter.iterations + 1
    if (!counting) say("could not attach the superstep counter to Pregel's logger")
    val reached = dist.filter(_._2 < inf).count()
    val maxDist = if (reached > 0) dist.filter(_._2 < inf).values.max() else 0.0
    say(f"$algorithm: $reached%d vertices reached, $supersteps%d supersteps, in $computeS%.2f s")
    t = now()
    o.get("out").foreach(out => writeValues(dist, out))
    val writeS = secs(t)
    Seq("engine" -> "graphx",
      "algorithm" -> (if (algorithm == "shortestpaths") "org.apache.spark.graphx.lib.ShortestPaths.run (reversed graph, hop counts)"
                      else "graphx Pregel SSSP on edge weights"),
      "vertices" -> nv, "edges" -> ne, "weighted_input" -> weighted, "source" -> source,
      "partitions" -> g.edges.getNumPartitions, "reached" -> reached, "max_distance" -> maxDist,
      "supersteps" -> (if (counting) supersteps else null),
      "load_s" -> loadS, "compute_s" -> computeS,
      "per_superstep_s" -> (if (counting) computeS / supersteps else null),
      "write_s" -> writeS, "total_s" -> (loadS + computeS + writeS))
  }

  /** Writes `records` (key, value) from offset `first` (in records) of the file at `path`. */
  private def writeAt(path: String, first: Long, records: Iterator[(Array[Byte], Array[Byte])]): Long = {
    val ch = new RandomAccessFile(path, "rw").getChannel
    val buf = ByteBuffer.allocateDirect(1 << 20)
    var pos = first * 100
    var n = 0L
    def flush(): Unit = { buf.flip(); while (buf.hasRemaining) pos += ch.write(buf, pos); buf.clear() }
    try {
      records.foreach { case (k, v) => if (buf.remaining < 100) flush(); buf.put(k); buf.put(v); n += 1 }
      flush()
    } finally ch.close()
    n
  }

  private def sort(sc: SparkContext, o: Map[String, String]): Seq[(String, Any)] = {
    val parts = o("partitions").toInt
    val outPath = new File(o("out")).getAbsolutePath
    val mode = o.getOrElse("mode", "phased")
    implicit val ordering: Ordering[Array[Byte]] = KeyOrdering
    // key = first 10 bytes, value = the other 90 (as spark-terasort keys its records).
    def keyed(r: RDD[Array[Byte]]) =
      r.map(x => (java.util.Arrays.copyOfRange(x, 0, 10), java.util.Arrays.copyOfRange(x, 10, 100)))
    val common = Seq("engine" -> "spark-rdd", "algorithm" -> "binaryRecords + sortByKey (RangePartitioner)",
      "mode" -> mode, "partitions" -> parts)
    if (mode == "pipelined") {
      // One pass as a TeraSort job runs: sortByKey (its RangePartitioner samples the input
      // first, a job of its own), then one job reads, shuffles, sorts and writes each
      // partition to a part file; the driver then concatenates the parts in order.
      val t = now()
      val sorted = keyed(sc.binaryRecords(o("records"), 100)).sortByKey(ascending = true, numPartitions = parts)
      val sampleS = secs(t)
      val partPath = (i: Int) => f"$outPath.part-$i%05d"
      val counts = sorted.mapPartitionsWithIndex { (i, it) =>
        val p = partPath(i)
        new RandomAccessFile(p, "rw").setLength(0)
        Iterator.single((i, writeAt(p, 0, it)))
      }.collect().sortBy(_._1).map(_._2)
      val shuffleS = secs(t) - sampleS
      val t2 = now()
      val out = new RandomAccessFile(outPath, "rw")
      try {
        out.setLength(0)
        val ch = out.getChannel
        for (i <- counts.indices) {
          val in = new RandomAccessFile(partPath(i), "r").getChannel
          try {
            var done = 0L
            while (done < in.size) done += in.transferTo(done, in.size - done, ch)
          } finally in.close()
          new File(partPath(i)).delete()
        }
      } finally out.close()
      val concatS = secs(t2)
      val n = counts.sum
      say(f"sorted $n%d records: sample $sampleS%.2f s, read+shuffle+sort+write parts $shuffleS%.2f s, concatenate $concatS%.2f s")
      return common ++ Seq("records" -> n, "bytes" -> n * 100, "sample_s" -> sampleS,
        "shuffle_sort_write_s" -> shuffleS, "concat_s" -> concatS, "total_s" -> (sampleS + shuffleS + concatS))
    }
    require(mode == "phased", s"mode must be phased or pipelined, not $mode")
    // Read: the records, 100 bytes each, cached and counted.
    var t = now()
    val records = sc.binaryRecords(o("records"), 100).persist(StorageLevel.MEMORY_AND_DISK)
    val n = records.count()
    val readS = secs(t)
    say(f"read $n%d records in $readS%.2f s (${records.getNumPartitions}%d input partitions)")
    // Sort: sortByKey (RangePartitioner's sample, shuffle, sort) into `parts` partitions,
    // cached, and counted per partition.
    t = now()
    val sorted = keyed(records).sortByKey(ascending = true, numPartitions = parts).persist(StorageLevel.MEMORY_AND_DISK)
    val counts = sorted.mapPartitionsWithIndex((i, it) => Iterator((i, it.size.toLong))).collect().sortBy(_._1).map(_._2)
    val sortS = secs(t)
    records.unpersist(false)
    say(f"sorted into ${counts.length}%d partitions in $sortS%.2f s")
    // Write: every partition writes its records at its offset in one local file, in parallel.
    t = now()
    val offsets = counts.scanLeft(0L)(_ + _)
    val f = new RandomAccessFile(outPath, "rw")
    try { f.setLength(0); f.setLength(offsets.last * 100) } finally f.close()
    sorted.mapPartitionsWithIndex((i, it) => Iterator.single(writeAt(outPath, offsets(i), it))).count()
    val writeS = secs(t)
    say(f"wrote $outPath in $writeS%.2f s")
    common ++ Seq("records" -> n, "bytes" -> n * 100,
      "read_s" -> readS, "sort_s" -> sortS, "write_s" -> writeS, "total_s" -> (readS + sortS + writeS))
  }
}
