//! Opening a slab device: read its header, and format it (header marked "formatting", the
//! slot table zeroed, header marked ready) when it holds no store or the config asks to.

use crate::error::{Error, Result};
use crate::io::{OpenedDevice, Region, Storage};
use crate::slab::{table_bytes, Geometry, Header, HeaderRead, HeaderState, HEADER_BYTES};

/// Reads a device's header and formats it if needed; returns its geometry and whether it was
/// formatted now.
pub(crate) fn prepare_slab(
    storage: &dyn Storage,
    index: usize,
    info: &OpenedDevice,
    block_bytes: u64,
    overwrite: bool,
) -> Result<(Geometry, bool)> {
    if info.align_bytes > crate::slab::TABLE_PAGE_BYTES as u64 {
        return Err(Error::device(
            &info.path,
            format!(
                "direct I/O alignment {} bytes is above the 4096 this layout supports",
                info.align_bytes
            ),
        ));
    }
    let geometry = Geometry::compute(info.size_bytes, block_bytes, info.align_bytes.max(4096))
        .ok_or_else(|| {
            Error::device(
                &info.path,
                format!(
                    "{} bytes is too small for one {block_bytes}-byte slot and the slot table",
                    info.size_bytes
                ),
            )
        })?;
    let page = Region::allocate(HEADER_BYTES as usize, kvtier_sys::mem::HugePages::Off)
        .map_err(|e| Error::Memory(e.to_string()))?;
    storage.read_sync(index, 0, &page, 0, HEADER_BYTES as usize)?;
    let mut raw = vec![0u8; HEADER_BYTES as usize];
    page.read(0, &mut raw);
    let reason = match Header::decode(&raw) {
        HeaderRead::Valid(h) if h.state == HeaderState::Ready && h.geometry == geometry => {
            return Ok((geometry, false));
        }
        HeaderRead::Valid(h) if h.state == HeaderState::Formatting => None,
        HeaderRead::Empty => None,
        HeaderRead::Valid(h) if h.geometry.block_bytes != block_bytes => Some(format!(
            "holds a kvtier store formatted for block_size {} bytes, the config says {block_bytes}",
            h.geometry.block_bytes
        )),
        HeaderRead::Valid(h) => Some(format!(
            "holds a kvtier store of {} slots, this size and block_size give {} slots",
            h.geometry.slot_count, geometry.slot_count
        )),
        HeaderRead::Foreign(why) => Some(why),
    };
    if let Some(why) = reason {
        if !(overwrite || info.fresh) {
            return Err(Error::device(
                &info.path,
                format!("{why}; set `overwrite = true` on this device to reformat it (its contents are lost), or use another path"),
            ));
        }
        tracing::warn!(path = %info.path.display(), "{why}: reformatting (overwrite = true)");
    }
    format(storage, index, &page, geometry)?;
    Ok((geometry, true))
}

/// Writes a header marked "formatting", zeroes the slot table, then marks the header ready, so
/// an interrupted format is redone at the next open.
fn format(storage: &dyn Storage, index: usize, page: &Region, geometry: Geometry) -> Result<()> {
    let format_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()) << 32;
    let mut raw = vec![0u8; HEADER_BYTES as usize];
    let mut header = Header {
        state: HeaderState::Formatting,
        geometry,
        format_id,
    };
    header.encode(&mut raw);
    page.write(0, &raw);
    storage.write_sync(index, 0, page, 0, HEADER_BYTES as usize)?;
    let zeros_len = 1usize << 20;
    let zeros = Region::allocate(zeros_len, kvtier_sys::mem::HugePages::Off)
        .map_err(|e| Error::Memory(e.to_string()))?;
    let total = table_bytes(geometry.slot_count);
    let mut done = 0u64;
    while done < total {
        let len = (total - done).min(zeros_len as u64) as usize;
        storage.write_sync(index, geometry.table_offset + done, &zeros, 0, len)?;
        done += len as u64;
    }
    header.state = HeaderState::Ready;
    header.encode(&mut raw);
    page.write(0, &raw);
    storage.write_sync(index, 0, page, 0, HEADER_BYTES as usize)?;
    Ok(())
}
