//! What the one-rule-at-a-time scenario tests of the layouts (`slab::scenarios`,
//! `files::scenarios`) share: their block size, block contents and where a block sits in the
//! region, and the results a simulated node has published.

use crate::job::JobResult;
use crate::sim::cluster::Cluster;

/// The scenarios' block size.
pub const BLOCK: u64 = 8 << 10;

/// The bytes a scenario stores under key number `i`, different for every `i`.
pub fn content(i: u8) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|b| (b as u8).wrapping_mul(31) ^ i)
        .collect()
}

/// Where region block `block` starts.
pub fn at(block: u32) -> usize {
    block as usize * BLOCK as usize
}

/// The results `cluster` has published since the last call.
pub fn results(cluster: &Cluster) -> Vec<JobResult> {
    let mut out = Vec::new();
    cluster.poll(&mut out);
    out
}
