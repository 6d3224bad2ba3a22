//! Sizes: the parser behind every size field (`"512 KiB"`, `4096`), and how sizes and paths
//! are shown in errors and written back to TOML.

use std::path::Path;

use serde::Serializer;
use toml::Value;

use super::{GIB, KIB, MIB, TIB};

// Sizes.

/// Why a size string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("not a number followed by an optional unit")]
    Malformed,
    #[error("unknown unit `{0}`")]
    UnknownUnit(String),
    #[error("not a whole number of bytes")]
    NotWholeBytes,
    #[error("more than 2^64 - 1 bytes")]
    TooLarge,
}

/// Parses a size such as `"4096"`, `"512KiB"`, `"2 MiB"` or `"1.5 GiB"` into bytes.
///
/// Units (case-insensitive, optionally after spaces): none or `B` for bytes; `KiB`, `MiB`,
/// `GiB`, `TiB` and the short `K`, `M`, `G`, `T` are binary; `KB`, `MB`, `GB`, `TB` decimal.
/// A fraction is allowed as long as the result is a whole number of bytes.
///
/// # Errors
///
/// [`SizeError`] saying what is wrong with `text`.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    // Longer fractions (after trailing zeros) are refused as malformed: nobody writes them, and
    // the bound keeps the arithmetic below within u128.
    const FRACTION_DIGITS_MAX: u32 = 20;

    let text = text.trim();
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_end);
    if number.is_empty() {
        return Err(SizeError::Malformed);
    }
    let unit_bytes = unit_bytes(unit.trim_start())
        .ok_or_else(|| SizeError::UnknownUnit(unit.trim_start().to_owned()))?;
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let fraction = fraction.trim_end_matches('0');
    if whole.is_empty()
        || number.ends_with('.')
        || fraction.contains('.')
        || fraction.len() > FRACTION_DIGITS_MAX as usize
    {
        return Err(SizeError::Malformed);
    }
    // Both parts are ASCII digits by now, so parsing fails only on overflow.
    let whole: u128 = whole.parse().map_err(|_| SizeError::TooLarge)?;
    let mut bytes = whole * u128::from(unit_bytes);
    if !fraction.is_empty() {
        let fraction_digits: u128 = fraction.parse().map_err(|_| SizeError::Malformed)?;
        let scale = 10u128.pow(u32::try_from(fraction.len()).map_err(|_| SizeError::Malformed)?);
        let scaled = fraction_digits * u128::from(unit_bytes);
        if !scaled.is_multiple_of(scale) {
            return Err(SizeError::NotWholeBytes);
        }
        bytes += scaled / scale;
    }
    u64::try_from(bytes).map_err(|_| SizeError::TooLarge)
}

pub(super) fn unit_bytes(unit: &str) -> Option<u64> {
    let bytes = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => MIB,
        "g" | "gib" => GIB,
        "t" | "tib" => TIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    Some(bytes)
}

/// `bytes` as a whole number of the largest binary unit that divides it, e.g. `2 MiB`.
pub(super) fn whole_binary_units(bytes: u64) -> Option<String> {
    [(TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")]
        .into_iter()
        .find(|&(unit, _)| bytes >= unit && bytes.is_multiple_of(unit))
        .map(|(unit, name)| format!("{} {name}", bytes / unit))
}

/// A size as it would be written in TOML: `"2 MiB"` when exact, else the integer.
pub(super) fn show_size(bytes: u64) -> String {
    whole_binary_units(bytes).map_or_else(|| bytes.to_string(), |text| format!("\"{text}\""))
}

pub(super) fn show_path(path: &Path) -> String {
    Value::String(path.display().to_string()).to_string()
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` passes a reference
pub(super) fn serialize_size<S: Serializer>(bytes: &u64, serializer: S) -> Result<S::Ok, S::Error> {
    match whole_binary_units(*bytes) {
        Some(text) => serializer.serialize_str(&text),
        // TOML integers are i64; larger sizes go out as digit strings, which parse back.
        None if i64::try_from(*bytes).is_err() => serializer.serialize_str(&bytes.to_string()),
        None => serializer.serialize_u64(*bytes),
    }
}

#[allow(clippy::ref_option)] // serde's `serialize_with` passes a reference
pub(super) fn serialize_size_opt<S: Serializer>(
    bytes: &Option<u64>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match bytes {
        Some(bytes) => serialize_size(bytes, serializer),
        None => serializer.serialize_none(),
    }
}
