//! Error text: caller input cut to a size a message may repeat, and an error with
//! its causes as one line.

use std::borrow::Cow;

/// Longest piece of caller input an error message repeats.
pub(crate) const ECHO_LIMIT: usize = 200;

/// `s` as an error message may repeat it: at most [`ECHO_LIMIT`] bytes (cut at a
/// character boundary, with the length said), so that a huge name cannot make an
/// error larger than a client accepts as metadata.
pub fn truncated(s: &str) -> Cow<'_, str> {
    cut(s, ECHO_LIMIT)
}

/// `s` cut to at most `limit` bytes at a character boundary, its length said.
pub(crate) fn cut(s: &str, limit: usize) -> Cow<'_, str> {
    if s.len() <= limit {
        return s.into();
    }
    let mut end = limit;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len()).into()
}

/// `e` and its causes, `outer: inner: innermost`, without repeating a cause whose
/// text the outer message already includes.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_input_is_cut_and_says_its_length() {
        let long = "x".repeat(100_000);
        let t = truncated(&long);
        assert!(t.len() < 300 && t.contains("100000 bytes"), "{t}");
        let multibyte = "é".repeat(150);
        assert!(truncated(&multibyte).starts_with(&"é".repeat(100)));
        assert_eq!(truncated("short"), "short");
    }
}
