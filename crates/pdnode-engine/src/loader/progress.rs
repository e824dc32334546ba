//! A byte-count progress bar on stderr while loading large files, shown only when stderr is a
//! terminal (never in logs or tests).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// Files smaller than this load without a bar.
const MIN_BYTES: u64 = 256 << 20;

pub struct LoadProgress {
    bar: Option<ProgressBar>,
}

impl LoadProgress {
    /// A bar for `total` bytes labelled `what`; hidden for small totals or a non-terminal stderr.
    pub fn new(what: &str, total: u64) -> Self {
        if total < MIN_BYTES || !std::io::stderr().is_terminal() {
            return Self { bar: None };
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(format!("loading {what}"));
        Self { bar: Some(bar) }
    }

    pub fn inc(&self, bytes: u64) {
        if let Some(b) = &self.bar {
            b.inc(bytes);
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
