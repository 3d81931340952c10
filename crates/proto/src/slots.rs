//! Tags for in-flight requests.
//!
//! A tag is a slot index in its low 16 bits and the slot's generation in its high 16 bits, like
//! an NVMe command id with a phase. The generation changes every time a slot is reused, so a
//! completion for a tag that already completed (a duplicate, or a target bug) is caught instead
//! of being delivered to whichever request reuses the slot. Capacity is fixed at construction;
//! nothing allocates afterwards.

/// Largest capacity: slot indices must fit in 16 bits.
pub const SLOTS_MAX: usize = 1 << 16;

#[derive(Debug)]
struct Slot<T> {
    generation: u16,
    value: Option<T>,
}

/// A fixed-capacity table of in-flight requests keyed by tag.
#[derive(Debug)]
pub struct SlotTable<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u16>,
}

impl<T> SlotTable<T> {
    /// # Panics
    /// If `capacity` is zero or above [`SLOTS_MAX`] (a configuration bug).
    pub fn new(capacity: usize) -> SlotTable<T> {
        assert!((1..=SLOTS_MAX).contains(&capacity), "slot capacity {capacity} out of range");
        let slots = (0..capacity).map(|_| Slot { generation: 0, value: None }).collect();
        // Pop from the end: hand out low indices first, which keeps tags small and readable.
        let free = (0..capacity as u32).rev().map(|i| i as u16).collect();
        SlotTable { slots, free }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.free.len() == self.slots.len()
    }

    pub fn is_full(&self) -> bool {
        self.free.is_empty()
    }

    /// Take a free slot for `value`; gives it back when the table is full.
    pub fn insert(&mut self, value: T) -> Result<u32, T> {
        let Some(index) = self.free.pop() else {
            return Err(value);
        };
        let slot = &mut self.slots[index as usize];
        // A free slot that still held a request would hand its tag, and later its completion,
        // to the new one: the old request's buffer would never come back, or come back filled
        // with another's data.
        assert!(slot.value.is_none(), "slot {index} is on the free list but holds a request");
        slot.value = Some(value);
        Ok(tag_of(index, slot.generation))
    }

    pub fn get(&self, tag: u32) -> Option<&T> {
        let (index, generation) = split(tag);
        let slot = self.slots.get(index as usize)?;
        (slot.generation == generation).then_some(slot.value.as_ref()).flatten()
    }

    pub fn get_mut(&mut self, tag: u32) -> Option<&mut T> {
        let (index, generation) = split(tag);
        let slot = self.slots.get_mut(index as usize)?;
        if slot.generation != generation {
            return None;
        }
        slot.value.as_mut()
    }

    /// Complete the request behind `tag`, freeing its slot.
    pub fn remove(&mut self, tag: u32) -> Option<T> {
        let (index, generation) = split(tag);
        let slot = self.slots.get_mut(index as usize)?;
        if slot.generation != generation {
            return None;
        }
        let value = slot.value.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(index);
        Some(value)
    }

    /// Empty the table (the connection died), yielding every in-flight value.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.free.clear();
        let capacity = self.slots.len();
        self.free.extend((0..capacity as u32).rev().map(|i| i as u16));
        self.slots.iter_mut().filter_map(|s| {
            let v = s.value.take();
            if v.is_some() {
                s.generation = s.generation.wrapping_add(1);
            }
            v
        })
    }
}

fn tag_of(index: u16, generation: u16) -> u32 {
    u32::from(generation) << 16 | u32::from(index)
}

fn split(tag: u32) -> (u16, u16) {
    (tag as u16, (tag >> 16) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_to_capacity_and_refuses_more() {
        let mut t = SlotTable::new(3);
        let tags: Vec<u32> = (0..3).map(|i| t.insert(i).unwrap()).collect();
        assert!(t.is_full());
        assert_eq!(t.insert(99), Err(99));
        assert_eq!(t.remove(tags[1]), Some(1));
        assert_eq!(t.len(), 2);
        assert!(t.insert(7).is_ok());
    }

    #[test]
    fn stale_tags_are_rejected_after_reuse() {
        let mut t = SlotTable::new(1);
        let first = t.insert("a").unwrap();
        assert_eq!(t.remove(first), Some("a"));
        assert_eq!(t.remove(first), None, "a duplicate completion finds nothing");
        let second = t.insert("b").unwrap();
        assert_ne!(first, second, "same slot, new generation");
        assert_eq!(t.get(first), None);
        assert_eq!(t.get(second), Some(&"b"));
        assert_eq!(t.get(0xdead_0005), None, "out-of-range index");
    }

    #[test]
    fn generations_wrap_without_panicking() {
        let mut t = SlotTable::new(1);
        let mut last = 0;
        for _ in 0..70_000 {
            last = t.insert(()).unwrap();
            t.remove(last).unwrap();
        }
        assert_eq!(last >> 16, (69_999u32 % 65_536));
    }

    #[test]
    fn drain_returns_everything_and_resets() {
        let mut t = SlotTable::new(4);
        let a = t.insert(1).unwrap();
        t.insert(2).unwrap();
        let mut drained: Vec<_> = t.drain().collect();
        drained.sort();
        assert_eq!(drained, vec![1, 2]);
        assert!(t.is_empty());
        assert_eq!(t.get(a), None);
        assert_eq!(t.len(), 0);
    }
}
