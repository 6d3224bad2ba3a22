//! The primary region: the DRAM blocks that jobs move to and from the devices.
//!
//! kvtier can allocate it (hugetlb 2 MiB pages when reserved, else transparent hugepages, else
//! 4 KiB pages, per `hugepages` in the config) or take one the caller owns (for example a
//! shared-memory mapping a GPU runtime has pinned) through
//! [`kvtier_sys::mem::Region::from_raw_parts`].

use std::sync::Arc;

use crate::config::{Config, HugePages};
use crate::error::{Error, Result};
use crate::io::Region;

/// Allocates `region_blocks` blocks of `block_size` bytes, per the config's `hugepages`.
pub fn allocate(config: &Config) -> Result<Arc<Region>> {
    allocate_blocks(config.block_size, config.region_blocks, config.hugepages)
}

/// Allocates `blocks` blocks of `block_bytes` bytes.
pub fn allocate_blocks(block_bytes: u64, blocks: u64, hugepages: HugePages) -> Result<Arc<Region>> {
    let len = block_bytes
        .checked_mul(blocks)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| Error::Memory(format!("{blocks} blocks of {block_bytes} bytes overflow")))?;
    let huge = match hugepages {
        HugePages::Required => kvtier_sys::mem::HugePages::Required,
        HugePages::Auto => kvtier_sys::mem::HugePages::Auto,
        HugePages::Off => kvtier_sys::mem::HugePages::Off,
    };
    let region = Region::allocate(len, huge).map_err(|e| Error::Memory(e.to_string()))?;
    tracing::info!(
        bytes = len,
        backing = region.backing().as_str(),
        "primary region allocated"
    );
    // The mapping may be rounded up (to 2 MiB for huge pages); the engine uses whole blocks of it.
    Ok(Arc::new(region))
}
