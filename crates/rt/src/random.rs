//! Secrets from the kernel's random number generator (`getrandom(2)`), for keys that must
//! never be guessed: the capability secrets of exports, handshake nonces.

use std::io;

/// Fill `buf` with random bytes from the kernel, waiting for its pool to be initialised.
pub fn fill(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a live, exclusively borrowed buffer of `rest.len()` bytes, which is
        // exactly what getrandom writes at most.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast::<libc::c_void>(), rest.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        done += n as usize;
    }
    Ok(())
}

/// `N` random bytes.
pub fn bytes<const N: usize>() -> io::Result<[u8; N]> {
    let mut out = [0u8; N];
    fill(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_secrets_differ() {
        let a = super::bytes::<32>().unwrap();
        let b = super::bytes::<32>().unwrap();
        assert_ne!(a, b);
    }
}
