//! The budget axis of an experiment: each column a budget in tokens (`budgets`) or in bytes, a
//! fraction of the full prompt cache's (`bytes`), which each run resolves on its own trace to the
//! tokens that fit as its quantizer stores them. A stored run belongs to a column by what it was
//! given, not by the tokens it resolved to ([`StoredRun::ran_at`](super::StoredRun::ran_at)).

/// One column of the budget axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// Tokens per cache.
    Tokens(usize),
    /// A fraction of the full prompt cache's bytes.
    Bytes(f64),
}

impl Budget {
    /// The column's header: `B = 128`, or `1/8 of the bytes`.
    pub fn header(&self) -> String {
        match self {
            Budget::Tokens(tokens) => format!("B = {tokens}"),
            Budget::Bytes(fraction) => format!("{} of the bytes", fraction_text(*fraction)),
        }
    }

    /// The title of a plot's budget axis of this kind of column.
    pub fn axis_title(&self) -> &'static str {
        match self {
            Budget::Tokens(_) => "budget (tokens per cache)",
            Budget::Bytes(_) => "budget (fraction of the full cache's bytes)",
        }
    }

    /// Where the column sits on a plot's budget axis: its tokens, or its fraction.
    pub fn position(&self) -> f64 {
        match *self {
            Budget::Tokens(tokens) => tokens as f64,
            Budget::Bytes(fraction) => fraction,
        }
    }
}

/// Its value alone: `128`, or `1/8`.
impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Tokens(tokens) => write!(f, "{tokens}"),
            Budget::Bytes(fraction) => write!(f, "{}", fraction_text(*fraction)),
        }
    }
}

/// `1/n` for a fraction whose inverse is a whole number, the number itself otherwise.
fn fraction_text(fraction: f64) -> String {
    let inverse = 1.0 / fraction;
    match inverse.fract() == 0.0 && inverse <= 1e6 {
        true => format!("1/{inverse}"),
        false => format!("{fraction}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_named_by_what_they_give() {
        assert_eq!(Budget::Bytes(0.125).header(), "1/8 of the bytes");
        assert_eq!(Budget::Bytes(0.3).to_string(), "0.3");
        assert_eq!(Budget::Tokens(64).header(), "B = 64");
    }
}
