//! A bounds-checked cursor over untrusted big-endian bytes.
//!
//! Every read returns `None` when the input runs short, so the parsers built on it cannot
//! index out of range whatever a client sends.

use crate::STRING_MAX;

pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { rest: buf }
    }

    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.rest.split_at_checked(n)?;
        self.rest = tail;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    /// A string with a 32-bit length prefix. Longer than the spec's [`STRING_MAX`] counts as
    /// malformed, like a short read.
    pub(crate) fn string(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.u32()?).ok()?;
        if len > STRING_MAX {
            return None;
        }
        self.take(len)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_input_is_none_not_a_panic() {
        let mut r = Reader::new(&[0, 0, 0, 5, b'a', b'b']);
        assert_eq!(r.string(), None, "length says 5, only 2 bytes follow");
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u16(), Some(0x0102));
        assert_eq!(r.u16(), None);
        assert_eq!(r.take(1), Some(&[3u8][..]));
        assert!(r.is_empty());
    }

    #[test]
    fn strings_are_bounded() {
        let mut buf = (STRING_MAX as u32 + 1).to_be_bytes().to_vec();
        buf.resize(4 + STRING_MAX + 1, b'x');
        assert_eq!(Reader::new(&buf).string(), None);
        let mut buf = (STRING_MAX as u32).to_be_bytes().to_vec();
        buf.resize(4 + STRING_MAX, b'x');
        assert_eq!(Reader::new(&buf).string().map(<[u8]>::len), Some(STRING_MAX));
    }
}
