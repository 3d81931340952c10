//! The initiator's reconnection knobs on the command line (`skiff bench`, `skiff attach`),
//! named as SPDK and nvme-cli name them.

use std::time::Duration;

use clap::Args;
use initiator::ReconnectConfig;

use crate::units::{parse_duration, ArgError};

#[derive(Args, Debug, Clone, Copy)]
pub struct ReconnectArgs {
    /// After a lost connection, reconnect at most this far apart (attempts start at once and
    /// back off), re-sending every request not yet answered; `off`: fail at once.
    #[arg(long, default_value = "1s", value_parser = parse_off_or_duration)]
    // Spelled in full so clap takes the parser's `Option` as the value, not as "optional".
    reconnect_delay: std::option::Option<Duration>,
    /// Give up reconnecting after this long; requests then fail.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    ctrl_loss_timeout: Duration,
    /// Fail waiting requests after this long while reconnecting goes on (`off`: they wait until
    /// the connection is back or ctrl_loss_timeout gives up).
    #[arg(long, default_value = "off", value_parser = parse_off_or_duration)]
    fast_io_fail_timeout: std::option::Option<Duration>,
}

impl ReconnectArgs {
    pub fn config(&self) -> ReconnectConfig {
        let us = |d: Duration| d.as_micros() as u64;
        match self.reconnect_delay {
            None => ReconnectConfig::OFF,
            Some(delay) => ReconnectConfig {
                reconnect_delay_us: us(delay).max(1),
                ctrl_loss_timeout_us: us(self.ctrl_loss_timeout),
                fast_io_fail_timeout_us: self.fast_io_fail_timeout.map(us),
            },
        }
    }
}

fn parse_off_or_duration(s: &str) -> Result<Option<Duration>, ArgError> {
    match s {
        "off" | "0" => Ok(None),
        _ => parse_duration(s).map(Some),
    }
}
