//! A stop that does not wait for the requests in flight: the server's second stop signal, or
//! its drain's time running out.

use std::sync::Arc;
use tokio::sync::watch;

/// Ends every request in flight at once: each is cancelled in the engine (its pages freed)
/// and its client told so, a stream with an error event then `[DONE]`, a whole request with a
/// 503. Clones share one state; a job that starts after the abort ends at its first wait.
#[derive(Clone)]
pub struct Abort(Arc<watch::Sender<bool>>);

impl Default for Abort {
    fn default() -> Abort {
        Abort(Arc::new(watch::channel(false).0))
    }
}

impl Abort {
    pub fn new() -> Abort {
        Abort::default()
    }

    /// Ends every request in flight, and those that start later.
    pub fn abort(&self) {
        self.0.send_replace(true);
    }

    pub fn is_aborted(&self) -> bool {
        *self.0.borrow()
    }

    /// What a job waits on beside its events.
    pub(crate) fn watch(&self) -> watch::Receiver<bool> {
        self.0.subscribe()
    }
}
