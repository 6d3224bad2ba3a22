//! Which tier holds a key, as lookups answer.

/// Which tier answered a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Nvme,
    /// The object store (`[s3]`).
    S3,
}

/// The answer to a lookup, from the in-memory index (no I/O, no retry step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    Hit(Tier),
    Miss,
    /// Not known yet (reserved for tiers that answer asynchronously, such as S3).
    Pending,
}
