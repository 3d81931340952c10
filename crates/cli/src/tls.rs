//! TLS on the command line: `--tls`, `--tls-certificates` and `--tls-verify-peer` on `skiff
//! serve`, and `--tls-certificates` on the clients, with certificate directories laid out as
//! nbdkit and qemu's `tls-creds-x509` expect (`ca-cert.pem`, `server-cert.pem`,
//! `server-key.pem`, `client-cert.pem`, `client-key.pem`; crates/transport/src/tls.rs).

use std::path::PathBuf;

use clap::Args;
use transport::tls::{CertDir, TlsMode};

/// The TLS options of a client command.
#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// Connect over TLS, trusting the CA in DIR/ca-cert.pem and presenting DIR/client-cert.pem
    /// and DIR/client-key.pem when both are there.
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
}

impl TlsArgs {
    /// The client configuration, when TLS was asked for.
    pub fn config(&self) -> Result<Option<initiator::TlsConfig>, String> {
        let Some(dir) = &self.tls_certificates else { return Ok(None) };
        CertDir::new(dir.clone()).client_config().map(Some).map_err(|e| e.to_string())
    }
}

/// The target's TLS, from `--tls`, `--tls-certificates` and `--tls-verify-peer`.
pub fn listen(
    mode: TlsMode,
    certificates: Option<&PathBuf>,
    verify_peer: bool,
) -> Result<Option<server::TlsListen>, String> {
    match (mode, certificates) {
        (TlsMode::Off, _) => Ok(None),
        (_, None) => Err(format!("--tls {mode} needs --tls-certificates DIR")),
        (mode, Some(dir)) => {
            let config = CertDir::new(dir.clone()).server_config(verify_peer).map_err(|e| e.to_string())?;
            Ok(Some(server::TlsListen { mode, config, verify_peer }))
        }
    }
}
