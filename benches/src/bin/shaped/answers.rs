//! Answers compared across systems: CSV rows, numbers within rounding, ties under
//! ORDER BY as multisets.

/// CSV rows as fields (quotes honoured); the header is dropped.
pub(crate) fn rows(csv: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in csv.lines().skip(1) {
        let mut fields = Vec::new();
        let mut cur = String::new();
        let mut quoted = false;
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '"' if quoted && chars.peek() == Some(&'"') => {
                    cur.push('"');
                    chars.next();
                }
                '"' => quoted = !quoted,
                ',' if !quoted => fields.push(std::mem::take(&mut cur)),
                c => cur.push(c),
            }
        }
        fields.push(cur);
        out.push(fields);
    }
    out
}

pub(crate) fn same_value(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => (x - y).abs() <= 1e-6 * x.abs().max(y.abs()).max(1.0),
        _ => a.trim() == b.trim(),
    }
}

pub(crate) fn same_rows(a: &[Vec<String>], b: &[Vec<String>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(u, v)| same_value(u, v)))
}

/// Equal in order, or (ties under ORDER BY) equal as sorted multisets.
pub(crate) fn same_answer(a: &str, b: &str) -> bool {
    let (mut x, mut y) = (rows(a), rows(b));
    if same_rows(&x, &y) {
        return true;
    }
    x.sort();
    y.sort();
    same_rows(&x, &y)
}
