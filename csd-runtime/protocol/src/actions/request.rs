//! [`ActionRequest`]: a `DoAction` request typed by its name and its answer, as JSON
//! both ways.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// A typed `DoAction` request.
pub trait ActionRequest: Serialize + DeserializeOwned {
    /// The action's name (`Action.type`).
    const TYPE: &'static str;
    /// What `ListActions` says of it.
    const DESCRIPTION: &'static str;
    /// The answer's body.
    type Response: Serialize + DeserializeOwned;

    /// The request as a Flight action.
    fn to_action(&self) -> Result<arrow_flight::Action> {
        let body = serde_json::to_vec(self).map_err(|e| Error::Internal(e.to_string()))?;
        Ok(arrow_flight::Action::new(Self::TYPE, body))
    }

    /// Decodes an action body (empty: `{}`).
    fn decode(body: &[u8]) -> Result<Self> {
        let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            body
        };
        serde_json::from_slice(body).map_err(|e| {
            Error::InvalidArgument(format!(
                "the body of action {:?} is not the JSON it takes: {e}",
                Self::TYPE
            ))
        })
    }
}
