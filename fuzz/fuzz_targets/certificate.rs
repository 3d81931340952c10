//! Client certificates from fuzzer bytes: `skiff_transport::tls::certificate_principal`, which
//! the target runs on a verified certificate's DER to name an NBD client's principal. No panic,
//! and a principal is never the empty name.
#![no_main]

use libfuzzer_sys::fuzz_target;
use skiff_transport::tls::certificate_principal;

fuzz_target!(|data: &[u8]| {
    let der = rustls_pki_types::CertificateDer::from(data);
    if let Some(name) = certificate_principal(&der) {
        assert!(!name.is_empty());
    }
});
