//! Config errors that point at the place in the file: `file:line:column:
//! plain sentence`, the way compilers report, so an operator's editor can
//! jump to it.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One problem in one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the problem is not about a place in the file (it
    /// cannot be read, say).
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl ConfigError {
    /// A problem at a byte range of `source`.
    pub fn at(file: &Path, source: &str, span: Option<Range<usize>>, message: impl Into<String>) -> Self {
        let (line, column) = span.map_or((1, 1), |s| line_col(source, s.start));
        ConfigError { file: file.to_path_buf(), line, column, message: message.into() }
    }

    /// A problem with the file as a whole.
    pub fn file(file: &Path, message: impl Into<String>) -> Self {
        ConfigError { file: file.to_path_buf(), line: 0, column: 0, message: message.into() }
    }

    /// A TOML syntax or type error, with toml's own position.
    pub fn from_toml(file: &Path, source: &str, err: &toml::de::Error) -> Self {
        let message = err.message().trim().trim_end_matches('.').to_string();
        ConfigError::at(file, source, err.span(), message)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(f, "{}:{}:{}: {}", self.file.display(), self.line, self.column, self.message)
        }
    }
}

/// Every problem found, in file order. Loading does not stop at the first
/// one: `tollgate check` lists them all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl From<ConfigError> for ConfigErrors {
    fn from(e: ConfigError) -> Self {
        ConfigErrors(vec![e])
    }
}

/// 1-based line and column (in characters) of a byte offset.
pub fn line_col(source: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(source.len());
    let before = &source[..floor_char_boundary(source, offset)];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Where a file's lines start, for the line of many positions: each entry
/// of a file of thousands of rules records its line, and counting from the
/// file's start for each would cost the file's length every time.
pub struct Lines(Vec<usize>);

impl Lines {
    pub fn of(source: &str) -> Lines {
        // A plain loop into a vector sized for lines of 16 bytes or more:
        // half the instructions of a filtered iterator's collect (which
        // cannot know the size) on a file of 10,000 rules.
        let mut newlines = Vec::with_capacity(source.len() / 16);
        for (i, &b) in source.as_bytes().iter().enumerate() {
            if b == b'\n' {
                newlines.push(i);
            }
        }
        Lines(newlines)
    }

    /// The 1-based line of byte `offset`, as [`line_col`] counts it.
    pub fn line(&self, offset: usize) -> usize {
        self.0.partition_point(|&newline| newline < offset) + 1
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_agree_with_line_col_at_every_offset() {
        let src = "a = 1\n\nb = \"é\"\n[[rule]]\nname = \"x\"";
        let lines = Lines::of(src);
        for offset in 0..=src.len() + 2 {
            assert_eq!(lines.line(offset), line_col(src, offset).0, "offset {offset}");
        }
    }

    #[test]
    fn positions_are_one_based() {
        let src = "a = 1\nbb = 2\n";
        assert_eq!(line_col(src, 0), (1, 1));
        assert_eq!(line_col(src, 6), (2, 1));
        assert_eq!(line_col(src, 8), (2, 3));
        assert_eq!(line_col(src, 999), (3, 1));
    }

    #[test]
    fn display_is_file_line_column_message() {
        let e = ConfigError::at(Path::new("r.toml"), "x\ny = 0", Some(2..3), "limit must be at least 1");
        assert_eq!(e.to_string(), "r.toml:2:1: limit must be at least 1");
    }
}
