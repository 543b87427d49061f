//! Typed errors of the kernels crate.

/// Everything a kernel call can refuse. Sizes and indices a user or peer can
/// influence end up here instead of in a panic.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// The backend cannot be used in this build or on this machine.
    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),

    /// A buffer does not have the number of elements its shape demands.
    #[error("{op}: buffer `{name}` has {got} elements, expected {expected}")]
    ShapeMismatch {
        /// The op that refused.
        op: &'static str,
        /// Which argument.
        name: &'static str,
        /// Elements the shape demands.
        expected: usize,
        /// Elements the buffer has.
        got: usize,
    },

    /// A shape that cannot be computed (zero width where the math divides by it,
    /// fewer rows than queries, ...).
    #[error("{op}: invalid shape: {reason}")]
    InvalidShape {
        /// The op that refused.
        op: &'static str,
        /// What is wrong, naming the values involved.
        reason: String,
    },

    /// The device runtime failed a call (launch, copy, allocation) after the
    /// backend was constructed.
    #[error("{op}: device error: {message}")]
    Device {
        /// The op that failed.
        op: &'static str,
        /// What the runtime said.
        message: String,
    },

    /// A shape whose element count does not fit in `usize`.
    #[error("{op}: shape {dims:?} overflows usize")]
    SizeOverflow {
        /// The op that refused.
        op: &'static str,
        /// The dimensions that were multiplied.
        dims: Vec<usize>,
    },

    /// An index read from a buffer (token id, cursor) is outside its range.
    #[error("{op}: {what} {index} at position {position} is outside 0..{bound}")]
    IndexOutOfRange {
        /// The op that refused.
        op: &'static str,
        /// What the index means (token id, replay cursor).
        what: &'static str,
        /// The offending value.
        index: i64,
        /// Where in the index buffer it was found (token or slot).
        position: usize,
        /// The exclusive upper bound.
        bound: usize,
    },

    /// A copy range that runs past the end of a buffer.
    #[error("{op}: range {offset}..{offset}+{len} is outside a buffer of {buf_len} elements ({name})")]
    RangeOutOfBounds {
        /// The op that refused.
        op: &'static str,
        /// Which argument.
        name: &'static str,
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Length of the buffer.
        buf_len: usize,
    },

    /// The backend has no such facility (device regions on the CPU backend,
    /// whose regions are host memory).
    #[error("{op}: not supported by the {backend} backend: {reason}")]
    Unsupported {
        /// The op that refused.
        op: &'static str,
        /// The backend's name.
        backend: String,
        /// Why, and what to use instead.
        reason: String,
    },

    /// A replay ring has no room for the tokens being recorded: commit first.
    #[error("replay ring of slot {slot} is full: cursor {cursor} + {tokens} tokens > capacity {capacity}")]
    ReplayFull {
        /// The slot (batch index) whose ring is full.
        slot: usize,
        /// Tokens already recorded.
        cursor: usize,
        /// Tokens being appended.
        tokens: usize,
        /// Ring capacity in tokens.
        capacity: usize,
    },
}

/// Result alias of the kernels crate.
pub type Result<T> = std::result::Result<T, KernelError>;

/// `offset..offset + len` when it lies inside a buffer of `buf_len` elements,
/// else `RangeOutOfBounds` naming the op and the buffer (every backend's copies).
pub(crate) fn range(op: &'static str, name: &'static str, offset: usize, len: usize, buf_len: usize) -> Result<std::ops::Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= buf_len => Ok(offset..end),
        _ => Err(KernelError::RangeOutOfBounds { op, name, offset, len, buf_len }),
    }
}

/// Product of `dims`, or a `SizeOverflow` error naming `op`.
pub(crate) fn elems(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| KernelError::SizeOverflow { op, dims: dims.to_vec() })
}

/// Checks that buffer `name` of op `op` holds exactly `expected` elements.
pub(crate) fn check_len(op: &'static str, name: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected { Ok(()) } else { Err(KernelError::ShapeMismatch { op, name, expected, got }) }
}

/// Checks that units `units` of `n` elements each lie in a stacked buffer of
/// `stacked` elements (`Backend::add_units`).
pub(crate) fn check_units(op: &'static str, n: usize, stacked: usize, units: &std::ops::Range<usize>) -> Result<()> {
    if units.start > units.end || units.end.checked_mul(n).is_none_or(|e| e > stacked) {
        return Err(KernelError::InvalidShape { op, reason: format!("units {units:?} of {n} elements in a buffer of {stacked}") });
    }
    Ok(())
}

/// Refuses a zero dimension where the math needs it positive.
pub(crate) fn check_nonzero(op: &'static str, what: &'static str, value: usize) -> Result<()> {
    if value == 0 { Err(KernelError::InvalidShape { op, reason: format!("{what} must be positive, got 0") }) } else { Ok(()) }
}
