//! SQL scripts: statements split at the `;`s the SQL tokenizer sees, so that a `;`
//! inside a comment, a string literal or a quoted identifier does not end one.

use crate::error::{Error, Result};

/// Splits a script into statements at the `;`s the SQL tokenizer sees: not inside
/// comments, string literals or quoted identifiers. Returns the statements that a `;`
/// ended and the text after the last `;`; pieces holding only whitespace and comments
/// are dropped.
pub fn split_statements(text: &str) -> Result<(Vec<String>, String)> {
    use datafusion::sql::sqlparser::dialect::GenericDialect;
    use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer, Whitespace};
    let tokens = Tokenizer::new(&GenericDialect {}, text)
        .tokenize()
        .map_err(|e| Error::InvalidInput(format!("SQL: {e}")))?;
    let join = |cur: &[Token]| -> Option<String> {
        let meaningful = cur.iter().any(|t| !matches!(t, Token::Whitespace(_)));
        meaningful.then(|| {
            let sql: String = cur.iter().map(ToString::to_string).collect();
            sql.trim().to_string()
        })
    };
    let mut done = Vec::new();
    let mut cur: Vec<Token> = Vec::new();
    for t in tokens {
        match t {
            Token::SemiColon => {
                done.extend(join(&cur));
                cur.clear();
            }
            // A line comment's text ends at its newline; keep the newline so that what
            // follows is not commented out when the tokens are joined again.
            Token::Whitespace(Whitespace::SingleLineComment { comment, prefix })
                if !comment.ends_with('\n') =>
            {
                cur.push(Token::Whitespace(Whitespace::SingleLineComment {
                    comment: format!("{comment}\n"),
                    prefix,
                }));
            }
            t => cur.push(t),
        }
    }
    Ok((done, join(&cur).unwrap_or_default()))
}

/// Every statement of a script (the last needs no `;`).
pub fn statements(text: &str) -> Result<Vec<String>> {
    let (mut done, rest) = split_statements(text)?;
    if !rest.is_empty() {
        done.push(rest);
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semicolons_in_comments_strings_and_identifiers_do_not_split() {
        let script = "-- totals; by flag\nselect 1; /* a; b */ select 'x;y' as \"a;b\";\n-- trailing; comment\n";
        let s = statements(script).unwrap();
        assert_eq!(s.len(), 2, "{s:?}");
        assert!(s[0].starts_with("-- totals; by flag\n"), "{s:?}");
        assert!(s[0].ends_with("select 1"), "{s:?}");
        assert_eq!(s[1], "/* a; b */ select 'x;y' as \"a;b\"");
    }

    #[test]
    fn a_line_comment_does_not_swallow_the_next_line() {
        let s = statements("select 1 -- one\n+ 1").unwrap();
        assert_eq!(s, vec!["select 1 -- one\n+ 1".to_string()]);
    }

    #[test]
    fn the_unended_rest_is_kept_for_the_prompt() {
        let (done, rest) = split_statements("select 1; select\n 2").unwrap();
        assert_eq!(done, vec!["select 1".to_string()]);
        assert_eq!(rest, "select\n 2");
        // An open string literal is not a statement yet: the prompt reads on.
        assert!(split_statements("select 1; select 'a;").is_err());
    }

    #[test]
    fn only_comments_is_no_statement() {
        assert!(
            statements("-- nothing here;\n/* ; */ ;;")
                .unwrap()
                .is_empty()
        );
    }
}
