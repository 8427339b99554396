//! Sessions kept a moment for their caller. One statement through a Flight SQL
//! client is several calls — `CreatePreparedStatement`, `GetFlightInfo`, `DoGet` —
//! within milliseconds, and a session lists every node's tables: each caller's
//! session is reused while it is younger than [`FRESH_FOR`], so a table stored
//! since shows up within that time. The nodes still check the caller's token on
//! every request the session makes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::compute::session::CsdSession;

/// How long a caller's session is reused.
pub(crate) const FRESH_FOR: Duration = Duration::from_secs(2);
/// Most callers' sessions kept at once.
const MAX_KEPT: usize = 1024;

/// A session and when it was made.
type Kept = (Instant, Arc<CsdSession>);

#[derive(Default)]
pub(crate) struct Sessions {
    kept: Mutex<HashMap<[u8; 32], Kept>>,
}

impl Sessions {
    /// `caller`'s session if it is fresh.
    pub(crate) fn get(&self, caller: &[u8; 32]) -> Option<Arc<CsdSession>> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.get(caller)
            .filter(|(made, _)| made.elapsed() < FRESH_FOR)
            .map(|(_, s)| s.clone())
    }

    /// Keeps `session` for `caller`, letting stale ones go.
    pub(crate) fn put(&self, caller: [u8; 32], session: Arc<CsdSession>) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= MAX_KEPT {
            kept.retain(|_, (made, _)| made.elapsed() < FRESH_FOR);
        }
        if kept.len() < MAX_KEPT {
            kept.insert(caller, (Instant::now(), session));
        }
    }
}
