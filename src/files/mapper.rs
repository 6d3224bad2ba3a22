//! vLLM 0.33.0's `FileMapper`, path for path: where a block lives in a shared cache directory.
//!
//! A namespace is a run config (model, dtype, hash granularity, blocks per file, parallel sizes,
//! KV-cache groups, layout flags) serialized as JSON with sorted keys; the first 12 hex digits of
//! its sha256 name the directory, so engines that would write incompatible bytes never share
//! files. Block `<hash>` of group `g` lives at
//! `<root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<g>/<hash-hex>.bin` and `config.json` at
//! `<root>/<model>_<digest>/config.json`. Invariants:
//! * Paths are built by string concatenation exactly like vLLM's f-strings and never normalized:
//!   a root ending in `/` gives `//`, and the object-store prefix `"kv"` gives `kv//...` (contract
//!   §3). Model names only have `/` replaced by `_`; nothing else is escaped.
//! * JSON text is byte-identical to Python's `json.dumps(sort_keys=True)` (ASCII-only output with
//!   four-hex-digit escapes such as `\u00e9`, UTF-16 surrogate pairs above U+FFFF) with compact
//!   separators for the digest and `indent=2` for `config.json`; keys are sorted here, whatever
//!   order `serde_json::Map` keeps.
//! * Keys are vLLM offload keys: block hash followed by the group index as 4 big-endian bytes.
//!   [`FileMapper::parse_block_path`] accepts exactly the paths [`FileMapper::block_path`] produces
//!   under this mapper's data directory, so temp files and strays are never mistaken for blocks.
//! * The mapper does no I/O and is immutable once built.
//!
//! The field set is 0.33.0's; later vLLM releases add an optional `storage_format` field, which
//! would need a new optional [`Namespace`] field here.

use std::ffi::{OsStr, OsString};
use std::path::{Component, Path, PathBuf};

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Hex digits of the run-config sha256 that name the namespace directory.
pub const DIGEST_HEX_LEN: usize = 12;
/// File name of the run config inside the namespace directory (not the data directory).
pub const CONFIG_FILE_NAME: &str = "config.json";
/// Bytes of the group index at the end of an offload key.
pub const GROUP_INDEX_BYTES: usize = 4;
/// Value of the `inference_engine` field; vLLM always writes this one.
pub const INFERENCE_ENGINE: &str = "vllm";
/// Suffix of a published block file.
pub const BLOCK_FILE_SUFFIX: &str = ".bin";
/// Suffix of a block file still being written (`<dest>_<unique>.tmp`, vLLM's scheme).
pub const TEMP_FILE_SUFFIX: &str = ".tmp";

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

pub use crate::config::{KvCacheGroup, Namespace};

/// The caller's side of the parallel-agnostic decision: vLLM's `parallel_agnostic=` argument of
/// `FileMapper.from_offloading_spec`. The namespace collapses only when the caller requests it
/// *and* the configuration allows it (`parallel_agnostic` or `replicated_layout`); the
/// `replicated_layout` field is recorded only when requested, too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgnosticOptIn {
    /// What vLLM's fs and obj tiers pass (`parallel_agnostic=True`), so what kvtier uses.
    Requested,
    /// vLLM's default for other callers: the parallel identity is always kept.
    NotRequested,
}

/// Maps offload keys to paths (or object names) in one namespace. See the module docs.
#[derive(Clone, Debug)]
pub struct FileMapper {
    /// `<root>/<safe model>_<digest>`, never normalized.
    base_path: OsString,
    /// The effective rank: 0 when the namespace collapsed.
    rank: u64,
    collapsed: bool,
    run_config: Value,
    digest: String,
}

impl FileMapper {
    /// The mapper vLLM's FS tier builds for `root_dir` (it opts in to parallel agnosticism).
    #[must_use]
    pub fn new(root_dir: &Path, ns: &Namespace) -> FileMapper {
        FileMapper::with_opt_in(root_dir, ns, AgnosticOptIn::Requested)
    }

    /// The mapper for an explicit opt-in decision (see [`AgnosticOptIn`]).
    #[must_use]
    pub fn with_opt_in(root_dir: &Path, ns: &Namespace, opt_in: AgnosticOptIn) -> FileMapper {
        FileMapper::from_root(root_dir.as_os_str(), ns, opt_in)
    }

    /// The mapper vLLM's object-store tier builds: root `"<prefix>/"`, or `""` for an empty
    /// prefix, so names start `<prefix>//` or `/` (contract §3). Opts in like the FS tier.
    #[must_use]
    pub fn for_object_store(prefix: &str, ns: &Namespace) -> FileMapper {
        let root = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        FileMapper::from_root(OsStr::new(&root), ns, AgnosticOptIn::Requested)
    }

    /// The object name vLLM's obj tier uses for a block (builds the mapper each call; hold a
    /// [`FileMapper::for_object_store`] and use [`FileMapper::object_name`] on hot paths).
    #[must_use]
    pub fn object_key(prefix: &str, ns: &Namespace, block_hash: &[u8], group: u32) -> String {
        FileMapper::for_object_store(prefix, ns).object_name(block_hash, group)
    }

    fn from_root(root_dir: &OsStr, ns: &Namespace, opt_in: AgnosticOptIn) -> FileMapper {
        let requested = opt_in == AgnosticOptIn::Requested;
        let collapsed = requested && (ns.parallel_agnostic || ns.replicated_layout);
        let replicated = requested && ns.replicated_layout;
        let (tp, pp, pcp, dcp, rank) = if collapsed {
            (1, 1, 1, 1, 0)
        } else {
            (ns.tp_size, ns.pp_size, ns.pcp_size, ns.dcp_size, ns.rank)
        };

        let mut fields = Map::new();
        fields.insert("model_name".into(), Value::from(ns.model_name.as_str()));
        fields.insert("tokens_per_hash".into(), Value::from(ns.tokens_per_hash));
        fields.insert("blocks_per_file".into(), Value::from(ns.blocks_per_file));
        fields.insert("tp_size".into(), Value::from(tp));
        fields.insert("pp_size".into(), Value::from(pp));
        fields.insert("pcp_size".into(), Value::from(pcp));
        fields.insert("dcp_size".into(), Value::from(dcp));
        fields.insert("dtype".into(), Value::from(ns.dtype.as_str()));
        let groups = ns
            .kv_cache_groups
            .iter()
            .map(|group| {
                let mut entry = Map::new();
                entry.insert(
                    "tokens_per_block".into(),
                    Value::from(group.tokens_per_block),
                );
                let names = group.layer_names.iter().map(|n| Value::from(n.as_str()));
                entry.insert("layer_names".into(), Value::Array(names.collect()));
                Value::Object(entry)
            })
            .collect();
        fields.insert("kv_cache_groups".into(), Value::Array(groups));
        fields.insert("inference_engine".into(), Value::from(INFERENCE_ENGINE));
        // vLLM writes `false` only when not agnostic, and `replicated_layout` only when true, so
        // that namespaces created before those fields existed keep their digest.
        if !collapsed {
            fields.insert("parallel_agnostic".into(), Value::Bool(false));
        }
        if replicated {
            fields.insert("replicated_layout".into(), Value::Bool(true));
        }
        if let Some(format) = &ns.canonical_format {
            fields.insert("canonical_format".into(), Value::from(format.as_str()));
        }
        let run_config = Value::Object(fields);

        let compact = python_json(&run_config, None);
        let sha = Sha256::digest(compact.as_bytes());
        let mut digest = hex_lower(&sha);
        digest.truncate(DIGEST_HEX_LEN);

        let mut base_path = root_dir.to_os_string();
        base_path.push("/");
        base_path.push(ns.model_name.replace('/', "_"));
        base_path.push("_");
        base_path.push(&digest);

        FileMapper {
            base_path,
            rank,
            collapsed,
            run_config,
            digest,
        }
    }

    /// The run config: the exact field set vLLM puts in `config.json` and hashes.
    #[must_use]
    pub fn run_config(&self) -> Value {
        self.run_config.clone()
    }

    /// First [`DIGEST_HEX_LEN`] lowercase hex digits of sha256 of the compact, sorted-keys JSON.
    #[must_use]
    pub fn digest(&self) -> String {
        self.digest.clone()
    }

    /// The rank in the data directory name: 0 when the namespace collapsed.
    #[must_use]
    pub fn rank(&self) -> u64 {
        self.rank
    }

    /// Whether tp/pp/pcp/dcp were forced to 1 and the rank to 0.
    #[must_use]
    pub fn is_collapsed(&self) -> bool {
        self.collapsed
    }

    /// `<root>/<model with '/' -> '_'>_<digest>`: holds `config.json` (and vLLM's `O_DIRECT` probe).
    #[must_use]
    pub fn base_path(&self) -> PathBuf {
        PathBuf::from(self.base_path.clone())
    }

    /// `<base_path>_r<rank>`: holds the block files.
    #[must_use]
    pub fn data_dir(&self) -> PathBuf {
        PathBuf::from(self.data_dir_os())
    }

    /// `<base_path>/config.json`.
    #[must_use]
    pub fn config_file_path(&self) -> PathBuf {
        let mut path = self.base_path.clone();
        path.push("/");
        path.push(CONFIG_FILE_NAME);
        PathBuf::from(path)
    }

    /// The `config.json` text, as Python's `json.dump(obj, f, indent=2, sort_keys=True)` writes
    /// it (no trailing newline).
    #[must_use]
    pub fn config_json_text(&self) -> String {
        python_json(&self.run_config, Some(2))
    }

    /// `<data_dir>/<hhh>/<hh>_g<group>/<hash-hex>.bin`. Hashes shorter than 3 bytes give shorter
    /// directory names, as Python's slicing does.
    ///
    /// # Panics
    /// If `block_hash` is empty: no vLLM hash is, and the path would name no file.
    #[must_use]
    pub fn block_path(&self, block_hash: &[u8], group: u32) -> PathBuf {
        PathBuf::from(self.block_os(block_hash, group))
    }

    /// [`FileMapper::block_path`] for an offload key (hash ++ 4-byte big-endian group); `None`
    /// for keys without at least one hash byte.
    #[must_use]
    pub fn key_path(&self, key: &[u8]) -> Option<PathBuf> {
        let (hash, group) = split_key(key)?;
        Some(self.block_path(hash, group))
    }

    /// The block path as a string, for object stores (exact when the mapper came from
    /// [`FileMapper::for_object_store`], whose root is UTF-8).
    #[must_use]
    pub fn object_name(&self, block_hash: &[u8], group: u32) -> String {
        self.block_os(block_hash, group)
            .to_string_lossy()
            .into_owned()
    }

    /// The offload key of a block file under [`FileMapper::data_dir`]; `None` for any path
    /// `block_path` would not produce (temp files, `config.json`, other ranks, stray files,
    /// uppercase or odd-length hex, a group directory that does not match the hash).
    #[must_use]
    pub fn parse_block_path(&self, path: &Path) -> Option<Vec<u8>> {
        let relative = path.strip_prefix(Path::new(&self.data_dir_os())).ok()?;
        let mut parts = relative.components();
        let (
            Some(Component::Normal(top)),
            Some(Component::Normal(mid)),
            Some(Component::Normal(file)),
            None,
        ) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        parse_relative(top.to_str()?, mid.to_str()?, file.to_str()?)
    }

    /// The inverse of [`FileMapper::object_name`]: the offload key of an object name in this
    /// namespace, `None` for anything else.
    #[must_use]
    pub fn parse_object_name(&self, name: &str) -> Option<Vec<u8>> {
        let data_dir = self.data_dir_os();
        let rest = name.strip_prefix(data_dir.to_str()?)?.strip_prefix('/')?;
        let mut parts = rest.split('/');
        let (Some(top), Some(mid), Some(file), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        parse_relative(top, mid, file)
    }

    /// vLLM's temp name for a block being written: `<dest>_<unique>.tmp`, in the same directory,
    /// so a rename publishes it.
    #[must_use]
    pub fn temp_path(dest: &Path, unique: u64) -> PathBuf {
        let mut name = dest.as_os_str().to_os_string();
        name.push(format!("_{unique}{TEMP_FILE_SUFFIX}"));
        PathBuf::from(name)
    }

    /// Whether a file name is a block temp file (vLLM's or ours): `<hex>.bin_<token>.tmp`.
    #[must_use]
    pub fn is_temp_file_name(name: &OsStr) -> bool {
        let Some(name) = name.to_str() else {
            return false;
        };
        let Some(stem) = name.strip_suffix(TEMP_FILE_SUFFIX) else {
            return false;
        };
        let Some((block, token)) = stem.rsplit_once('_') else {
            return false;
        };
        !token.is_empty()
            && token.bytes().all(|b| b.is_ascii_alphanumeric())
            && block
                .strip_suffix(BLOCK_FILE_SUFFIX)
                .is_some_and(|hex| decode_lower_hex(hex).is_some())
    }

    fn data_dir_os(&self) -> OsString {
        let mut dir = self.base_path.clone();
        dir.push(format!("_r{}", self.rank));
        dir
    }

    fn block_os(&self, block_hash: &[u8], group: u32) -> OsString {
        assert!(!block_hash.is_empty(), "a block hash has at least one byte");
        let hash_hex = hex_lower(block_hash);
        let (top, mid) = shard_dirs(&hash_hex, group);
        let mut path = self.data_dir_os();
        path.push(format!("/{top}/{mid}/{hash_hex}{BLOCK_FILE_SUFFIX}"));
        path
    }
}

/// Splits an offload key into block hash and group index; `None` without a hash byte.
#[must_use]
pub fn split_key(key: &[u8]) -> Option<(&[u8], u32)> {
    if key.len() <= GROUP_INDEX_BYTES {
        return None;
    }
    let (hash, group) = key.split_at(key.len() - GROUP_INDEX_BYTES);
    let group: [u8; GROUP_INDEX_BYTES] = group.try_into().ok()?;
    Some((hash, u32::from_be_bytes(group)))
}

/// An offload key: the block hash followed by the group index as 4 big-endian bytes.
#[must_use]
pub fn make_key(block_hash: &[u8], group: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(block_hash.len() + GROUP_INDEX_BYTES);
    key.extend_from_slice(block_hash);
    key.extend_from_slice(&group.to_be_bytes());
    key
}

/// `(hash_hex[0:3], hash_hex[3:5] + "_g" + group)`, with Python's clamped slicing.
fn shard_dirs(hash_hex: &str, group: u32) -> (&str, String) {
    let top_end = hash_hex.len().min(3);
    let mid_end = hash_hex.len().min(5);
    (
        &hash_hex[..top_end],
        format!("{}_g{group}", &hash_hex[top_end..mid_end]),
    )
}

/// The key for `<top>/<mid>/<file>` if and only if `block_path` renders exactly those names.
fn parse_relative(top: &str, mid: &str, file: &str) -> Option<Vec<u8>> {
    let hash_hex = file.strip_suffix(BLOCK_FILE_SUFFIX)?;
    let hash = decode_lower_hex(hash_hex)?;
    let (_, group_text) = mid.split_once("_g")?;
    let group: u32 = group_text.parse().ok()?;
    // Re-render and compare: rejects leading zeros, `+`, and hash directories of another hash.
    let (want_top, want_mid) = shard_dirs(hash_hex, group);
    if top != want_top || mid != want_mid {
        return None;
    }
    Some(make_key(&hash, group))
}

fn hex_lower(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(HEX_DIGITS[usize::from(b >> 4)] as char);
        out.push(HEX_DIGITS[usize::from(b & 0xf)] as char);
    }
    out
}

/// Lowercase, even-length, non-empty hex only (what `bytes.hex()` produces).
fn decode_lower_hex(text: &str) -> Option<Vec<u8>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    if text.is_empty() || !text.len().is_multiple_of(2) {
        return None;
    }
    text.as_bytes()
        .chunks_exact(2)
        .map(|pair| Some((nibble(pair[0])? << 4) | nibble(pair[1])?))
        .collect()
}

/// Python's `json.dumps(value, sort_keys=True)` text: `indent = None` uses the compact
/// separators `(",", ":")`, `Some(n)` the `indent=n` layout (`","` at line ends, `": "`).
fn python_json(value: &Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_value(&mut out, value, indent, 0);
    out
}

fn write_value(out: &mut String, value: &Value, indent: Option<usize>, level: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => {
            // The run config holds only integers, which Python prints as plain decimals (its
            // float repr would differ from serde_json's).
            debug_assert!(n.is_u64() || n.is_i64(), "only integers are written: {n}");
            out.push_str(&n.to_string());
        }
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                write_separator(out, i, indent, level + 1);
                write_value(out, item, indent, level + 1);
            }
            write_close(out, indent, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            // Sorted here (code-point order, as Python's `sorted` on str) rather than relying
            // on `Map`'s order, which a `preserve_order` feature elsewhere would change.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                write_separator(out, i, indent, level + 1);
                write_string(out, key);
                out.push_str(if indent.is_some() { ": " } else { ":" });
                write_value(out, item, indent, level + 1);
            }
            write_close(out, indent, level);
            out.push('}');
        }
    }
}

/// Before the `i`-th item of a container whose items sit at `level`.
fn write_separator(out: &mut String, i: usize, indent: Option<usize>, level: usize) {
    if i > 0 {
        out.push(',');
    }
    if let Some(width) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', width * level));
    }
}

fn write_close(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(width) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', width * level));
    }
}

/// A JSON string as Python's encoder writes it with `ensure_ascii=True`: printable ASCII as is,
/// the short escapes for `"` `\` and `\n \r \t \b \f`, everything else as a `\u` escape of four
/// lowercase hex digits (e.g. `\u00e9`; UTF-16 surrogate pairs above U+FFFF), including DEL.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for &unit in c.encode_utf16(&mut units).iter() {
                    out.push_str("\\u");
                    for shift in [12, 8, 4, 0] {
                        out.push(HEX_DIGITS[usize::from((unit >> shift) & 0xf)] as char);
                    }
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    // Expected digests, compact JSON and config.json texts below were produced by CPython 3's
    // `json.dumps(fields, sort_keys=True, separators=(",", ":"))`, `hashlib.sha256` and
    // `json.dump(fields, f, indent=2, sort_keys=True)` on the field dicts vLLM builds, so they
    // cross-check this file's serializer byte for byte against Python's.
    use super::*;
    use serde_json::json;

    const ROOT: &str = "/tmp/cache";

    /// vLLM's test fixture: `make_mapper_from_offloading_spec()` defaults (test-model, float16,
    /// `tokens_per_hash` 16, `blocks_per_chunk` 1, all sizes 1, no groups).
    fn fixture_a(rank: u64) -> Namespace {
        Namespace {
            rank,
            ..Namespace::new("test-model", "float16", 16, 1)
        }
    }

    /// vLLM's `test_get_run_config_fields` fixture.
    fn fixture_b() -> Namespace {
        Namespace {
            tp_size: 4,
            pp_size: 3,
            pcp_size: 2,
            dcp_size: 2,
            kv_cache_groups: vec![KvCacheGroup {
                tokens_per_block: 64,
                layer_names: vec!["layer0".into()],
            }],
            ..Namespace::new("my-model", "bfloat16", 64, 3)
        }
    }

    /// Non-ASCII (BMP and astral), control characters, quotes and backslashes in names; every
    /// optional field present; a replicated layout that collapses TP 8.
    fn fixture_c() -> Namespace {
        Namespace {
            tp_size: 8,
            kv_cache_groups: vec![
                KvCacheGroup {
                    tokens_per_block: 16,
                    layer_names: vec![
                        "model.layers.0.attn".into(),
                        "couche_\u{e9}".into(),
                        "\u{5c42}".into(),
                        "emoji \u{1F600}".into(),
                        "q\" b\\ t\t n\n c\u{1} d\u{7f}".into(),
                    ],
                },
                KvCacheGroup {
                    tokens_per_block: 32,
                    layer_names: vec![],
                },
            ],
            parallel_agnostic: true,
            replicated_layout: true,
            canonical_format: Some("v1-nhd".into()),
            ..Namespace::new("org/Mod\u{e8}l-7B", "bfloat16", 16, 4)
        }
    }

    fn mapper(ns: &Namespace) -> FileMapper {
        FileMapper::new(Path::new(ROOT), ns)
    }

    fn path_str(path: &Path) -> &str {
        path.to_str().expect("test paths are UTF-8")
    }

    fn unhex(text: &str) -> Vec<u8> {
        decode_lower_hex(text).expect("test hex is valid")
    }

    // vLLM's test_get_file_name_full_structure: the concrete expected path, digest included. A
    // change in field set, key order, separators or path format would change it.
    #[test]
    fn vllm_example_path_is_reproduced_exactly() {
        let fm = mapper(&fixture_a(3));
        assert_eq!(fm.digest(), "de3bba26cf36");
        let key = make_key(&[0, 1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(
            path_str(&fm.key_path(&key).expect("key has a hash")),
            "/tmp/cache/test-model_de3bba26cf36_r3/000/10_g2/0001020304050607.bin"
        );
        assert_eq!(
            path_str(&fm.base_path()),
            "/tmp/cache/test-model_de3bba26cf36"
        );
        assert_eq!(
            path_str(&fm.data_dir()),
            "/tmp/cache/test-model_de3bba26cf36_r3"
        );
        assert_eq!(
            path_str(&fm.config_file_path()),
            "/tmp/cache/test-model_de3bba26cf36/config.json"
        );
        assert_eq!(fm.rank(), 3);
        assert!(!fm.is_collapsed());
    }

    // A 32-byte sha256 hash in a namespace with a '/' and non-ASCII in the model name: full
    // 64-digit hex name, model '/' -> '_', non-ASCII kept raw in the path (only JSON escapes it).
    #[test]
    fn full_length_hash_and_model_name_in_path() {
        let fm = mapper(&fixture_c());
        let hash = unhex("496aca80e4d8f29fb8e8cd816c3afb48d3f103970b3a2ee1600c08ca67326dee");
        assert_eq!(
            path_str(&fm.block_path(&hash, 7)),
            "/tmp/cache/org_Mod\u{e8}l-7B_eb893b437dbd_r0/496/ac_g7/\
             496aca80e4d8f29fb8e8cd816c3afb48d3f103970b3a2ee1600c08ca67326dee.bin"
        );
    }

    // Digest input and digest for three fixtures, including escapes and all optional fields.
    #[test]
    fn digest_matches_python() {
        let cases = [
            (
                fixture_a(3),
                r#"{"blocks_per_file":1,"dcp_size":1,"dtype":"float16","inference_engine":"vllm","kv_cache_groups":[],"model_name":"test-model","parallel_agnostic":false,"pcp_size":1,"pp_size":1,"tokens_per_hash":16,"tp_size":1}"#,
                "de3bba26cf36",
            ),
            (
                fixture_b(),
                r#"{"blocks_per_file":3,"dcp_size":2,"dtype":"bfloat16","inference_engine":"vllm","kv_cache_groups":[{"layer_names":["layer0"],"tokens_per_block":64}],"model_name":"my-model","parallel_agnostic":false,"pcp_size":2,"pp_size":3,"tokens_per_hash":64,"tp_size":4}"#,
                "fe0dcee33f5d",
            ),
            (
                fixture_c(),
                r#"{"blocks_per_file":4,"canonical_format":"v1-nhd","dcp_size":1,"dtype":"bfloat16","inference_engine":"vllm","kv_cache_groups":[{"layer_names":["model.layers.0.attn","couche_\u00e9","\u5c42","emoji \ud83d\ude00","q\" b\\ t\t n\n c\u0001 d\u007f"],"tokens_per_block":16},{"layer_names":[],"tokens_per_block":32}],"model_name":"org/Mod\u00e8l-7B","pcp_size":1,"pp_size":1,"replicated_layout":true,"tokens_per_hash":16,"tp_size":1}"#,
                "eb893b437dbd",
            ),
        ];
        for (ns, compact, digest) in cases {
            let fm = mapper(&ns);
            assert_eq!(python_json(&fm.run_config(), None), compact);
            assert_eq!(fm.digest(), digest);
            let safe_model = ns.model_name.replace('/', "_");
            assert_eq!(
                path_str(&fm.base_path()),
                format!("{ROOT}/{safe_model}_{digest}")
            );
        }
    }

    // config.json text: nesting, indentation, `": "`, empty list, escapes, no trailing newline.
    #[test]
    fn config_json_text_matches_python() {
        assert_eq!(
            mapper(&fixture_a(0)).config_json_text(),
            r#"{
  "blocks_per_file": 1,
  "dcp_size": 1,
  "dtype": "float16",
  "inference_engine": "vllm",
  "kv_cache_groups": [],
  "model_name": "test-model",
  "parallel_agnostic": false,
  "pcp_size": 1,
  "pp_size": 1,
  "tokens_per_hash": 16,
  "tp_size": 1
}"#
        );
        assert_eq!(
            mapper(&fixture_b()).config_json_text(),
            r#"{
  "blocks_per_file": 3,
  "dcp_size": 2,
  "dtype": "bfloat16",
  "inference_engine": "vllm",
  "kv_cache_groups": [
    {
      "layer_names": [
        "layer0"
      ],
      "tokens_per_block": 64
    }
  ],
  "model_name": "my-model",
  "parallel_agnostic": false,
  "pcp_size": 2,
  "pp_size": 3,
  "tokens_per_hash": 64,
  "tp_size": 4
}"#
        );
        assert_eq!(
            mapper(&fixture_c()).config_json_text(),
            r#"{
  "blocks_per_file": 4,
  "canonical_format": "v1-nhd",
  "dcp_size": 1,
  "dtype": "bfloat16",
  "inference_engine": "vllm",
  "kv_cache_groups": [
    {
      "layer_names": [
        "model.layers.0.attn",
        "couche_\u00e9",
        "\u5c42",
        "emoji \ud83d\ude00",
        "q\" b\\ t\t n\n c\u0001 d\u007f"
      ],
      "tokens_per_block": 16
    },
    {
      "layer_names": [],
      "tokens_per_block": 32
    }
  ],
  "model_name": "org/Mod\u00e8l-7B",
  "pcp_size": 1,
  "pp_size": 1,
  "replicated_layout": true,
  "tokens_per_hash": 16,
  "tp_size": 1
}"#
        );
    }

    // vLLM's test_get_run_config_fields and test_hybrid_file_identity: the exact field set, and
    // per-group tokens_per_block next to the resolved tokens_per_hash.
    #[test]
    fn run_config_field_set() {
        assert_eq!(
            mapper(&fixture_b()).run_config(),
            json!({
                "model_name": "my-model",
                "tokens_per_hash": 64,
                "blocks_per_file": 3,
                "tp_size": 4,
                "pp_size": 3,
                "pcp_size": 2,
                "dcp_size": 2,
                "dtype": "bfloat16",
                "kv_cache_groups": [{"tokens_per_block": 64, "layer_names": ["layer0"]}],
                "inference_engine": "vllm",
                "parallel_agnostic": false,
            })
        );
        let hybrid = Namespace {
            kv_cache_groups: vec![
                KvCacheGroup {
                    tokens_per_block: 12,
                    layer_names: vec!["full_layer".into()],
                },
                KvCacheGroup {
                    tokens_per_block: 16,
                    layer_names: vec!["mla_layer".into()],
                },
            ],
            ..Namespace::new("test-model", "float16", 4, 1)
        };
        let config = mapper(&hybrid).run_config();
        assert_eq!(config["tokens_per_hash"], json!(4));
        assert_eq!(
            config["kv_cache_groups"],
            json!([
                {"tokens_per_block": 12, "layer_names": ["full_layer"]},
                {"tokens_per_block": 16, "layer_names": ["mla_layer"]},
            ])
        );
    }

    fn parallel(tp: u64, rank: u64, agnostic: bool, replicated: bool) -> Namespace {
        Namespace {
            tp_size: tp,
            pp_size: 3,
            pcp_size: 2,
            dcp_size: 2,
            rank,
            parallel_agnostic: agnostic,
            replicated_layout: replicated,
            kv_cache_groups: vec![KvCacheGroup {
                tokens_per_block: 16,
                layer_names: vec!["layer0".into()],
            }],
            ..Namespace::new("shared-model", "bfloat16", 16, 1)
        }
    }

    fn with(ns: &Namespace, opt_in: AgnosticOptIn) -> FileMapper {
        FileMapper::with_opt_in(Path::new(ROOT), ns, opt_in)
    }

    // vLLM's parallel_agnostic tests: the namespace collapses only when the caller opts in AND
    // the config says agnostic; otherwise TP, rank and `parallel_agnostic: false` are kept.
    #[test]
    fn agnostic_collapses_only_with_opt_in_and_config() {
        use AgnosticOptIn::{NotRequested, Requested};
        let tp2 = with(&parallel(2, 1, true, false), Requested);
        let tp4 = with(&parallel(4, 3, true, false), Requested);
        assert_eq!(tp2.base_path(), tp4.base_path());
        assert_eq!(tp2.data_dir(), tp4.data_dir());
        assert_eq!((tp2.rank(), tp4.rank()), (0, 0));
        assert!(tp2.is_collapsed());
        let config = tp2.run_config();
        for field in ["tp_size", "pp_size", "pcp_size", "dcp_size"] {
            assert_eq!(config[field], json!(1), "{field}");
        }
        assert!(config.get("parallel_agnostic").is_none());
        assert!(path_str(&tp2.data_dir()).ends_with("_r0"));

        // Config disallows: opt-in ignored.
        let a = with(&parallel(2, 1, false, false), Requested);
        let b = with(&parallel(4, 1, false, false), Requested);
        assert_ne!(a.base_path(), b.base_path());
        assert_eq!(a.rank(), 1);
        assert_eq!(a.run_config()["tp_size"], json!(2));
        assert_eq!(a.run_config()["parallel_agnostic"], json!(false));

        // No opt-in: config's agnosticism ignored.
        let a = with(&parallel(2, 1, true, false), NotRequested);
        let b = with(&parallel(4, 1, true, false), NotRequested);
        assert_ne!(a.base_path(), b.base_path());
        assert_eq!(a.rank(), 1);
        assert_eq!(a.run_config()["parallel_agnostic"], json!(false));

        // Agnostic and specific layouts never share a directory, even at TP 1 rank 0.
        let agnostic = with(&parallel(1, 0, true, false), Requested);
        let specific = with(&parallel(1, 0, false, false), Requested);
        assert_ne!(agnostic.base_path(), specific.base_path());
    }

    // vLLM's replicated-layout tests: replicated collapses TP identity (rank 0, sizes 1,
    // `replicated_layout: true`) but only with the caller's opt-in, and differs from agnostic.
    #[test]
    fn replicated_layout_collapses_with_opt_in() {
        use AgnosticOptIn::{NotRequested, Requested};
        let tp2 = with(&parallel(2, 1, false, true), Requested);
        let tp4 = with(&parallel(4, 3, false, true), Requested);
        assert_eq!(tp2.base_path(), tp4.base_path());
        assert_eq!(tp2.run_config(), tp4.run_config());
        assert_eq!(tp4.rank(), 0);
        assert_eq!(tp4.run_config()["replicated_layout"], json!(true));
        assert!(tp4.run_config().get("parallel_agnostic").is_none());
        assert_eq!(
            tp4.block_path(&[1; 8], 0)
                .parent()
                .and_then(Path::parent)
                .and_then(Path::parent),
            Some(tp4.data_dir().as_path())
        );
        assert!(path_str(&tp4.data_dir()).ends_with("_r0"));

        let refused = with(&parallel(2, 1, false, true), NotRequested);
        let baseline = with(&parallel(2, 1, false, false), NotRequested);
        assert_eq!(refused.base_path(), baseline.base_path());
        assert_eq!(refused.run_config(), baseline.run_config());
        assert_eq!(refused.rank(), 1);
        assert!(refused.run_config().get("replicated_layout").is_none());

        let via_agnostic = with(&parallel(2, 1, true, false), Requested);
        let via_replicated = with(&parallel(2, 1, false, true), Requested);
        assert_ne!(via_agnostic.base_path(), via_replicated.base_path());
    }

    // The canonical byte format and the chunk size fork the namespace: files of one are not
    // readable as the other.
    #[test]
    fn canonical_format_and_blocks_per_file_change_namespace() {
        let direct = fixture_a(0);
        let canonical = Namespace {
            canonical_format: Some("v1-nhd".into()),
            ..direct.clone()
        };
        let bigger_chunks = Namespace {
            blocks_per_file: 16,
            ..direct.clone()
        };
        let direct_fm = mapper(&direct);
        let canonical_fm = mapper(&canonical);
        assert!(direct_fm.run_config().get("canonical_format").is_none());
        assert_eq!(
            canonical_fm.run_config()["canonical_format"],
            json!("v1-nhd")
        );
        assert_ne!(direct_fm.base_path(), canonical_fm.base_path());
        assert_ne!(direct_fm.base_path(), mapper(&bigger_chunks).base_path());
        assert_ne!(
            FileMapper::object_key("kv", &direct, &[7; 8], 0),
            FileMapper::object_key("kv", &bigger_chunks, &[7; 8], 0)
        );
    }

    // Keys of every hash length map to paths that parse back to the same key, and keys without
    // a hash byte are refused. Short hashes follow Python's clamped slicing.
    #[test]
    fn key_path_round_trip() {
        let fm = mapper(&fixture_a(3));
        let hashes: [&[u8]; 5] = [
            &[0xab],
            &[0xab, 0xcd],
            &[0, 1, 2, 3, 4, 5, 6, 7],
            &[0xff; 32],
            &[0; 60],
        ];
        for hash in hashes {
            for group in [0, 2, 255, u32::MAX] {
                let key = make_key(hash, group);
                let path = fm.key_path(&key).expect("key has a hash");
                assert_eq!(fm.parse_block_path(&path), Some(key.clone()), "{path:?}");
                assert_eq!(split_key(&key), Some((hash, group)));
                let name = fm.object_name(hash, group);
                assert_eq!(name, path_str(&path));
                assert_eq!(fm.parse_object_name(&name), Some(key));
            }
        }
        assert_eq!(
            path_str(&fm.block_path(&[0xab], 2)),
            "/tmp/cache/test-model_de3bba26cf36_r3/ab/_g2/ab.bin"
        );
        assert_eq!(
            path_str(&fm.block_path(&[0xab, 0xcd], 2)),
            "/tmp/cache/test-model_de3bba26cf36_r3/abc/d_g2/abcd.bin"
        );
        for short in [&[][..], &[0, 0, 0, 2][..]] {
            assert_eq!(fm.key_path(short), None);
            assert_eq!(split_key(short), None);
        }
    }

    // A directory scan meets temp files, config.json, the probe, other ranks' data and strays:
    // none of them may be taken for a block.
    #[test]
    fn parse_block_path_rejects_everything_else() {
        let fm = mapper(&fixture_a(3));
        let data = path_str(&fm.data_dir()).to_owned();
        let hex = "00a10203040506ff";
        let good = format!("{data}/00a/10_g2/{hex}.bin");
        let key = make_key(&[0, 0xa1, 2, 3, 4, 5, 6, 0xff], 2);
        assert_eq!(fm.parse_block_path(Path::new(&good)), Some(key));
        let rejected = [
            // temp files, ours and vLLM's
            format!("{data}/00a/10_g2/{hex}.bin_123456789.tmp"),
            path_str(&FileMapper::temp_path(Path::new(&good), 42)).to_owned(),
            // wrong depth
            format!("{data}/{hex}.bin"),
            format!("{data}/00a/{hex}.bin"),
            format!("{data}/00a/10_g2/x/{hex}.bin"),
            format!("{data}/00a/10_g2"),
            data.clone(),
            // bad hex: uppercase, odd length, non-hex, empty, wrong suffix
            format!("{data}/00a/10_g2/{}.bin", hex.to_uppercase()),
            format!("{data}/00A/10_g2/{}.bin", hex.to_uppercase()),
            format!("{data}/00a/10_g2/00a102030405060.bin"),
            format!("{data}/00z/10_g2/00z102030405060.bin"),
            format!("{data}/00a/10_g2/.bin"),
            format!("{data}/00a/10_g2/{hex}.BIN"),
            format!("{data}/00a/10_g2/{hex}"),
            // group dir not matching the hash, or not canonical
            format!("{data}/001/10_g2/{hex}.bin"),
            format!("{data}/00a/11_g2/{hex}.bin"),
            format!("{data}/00a/10_g02/{hex}.bin"),
            format!("{data}/00a/10_g+2/{hex}.bin"),
            format!("{data}/00a/10_g/{hex}.bin"),
            format!("{data}/00a/10_g4294967296/{hex}.bin"),
            format!("{data}/00a/10-g2/{hex}.bin"),
            // outside the data dir: other rank, config.json, probe file, relative path
            format!("{ROOT}/test-model_de3bba26cf36_r0/00a/10_g2/{hex}.bin"),
            path_str(&fm.config_file_path()).to_owned(),
            format!("{ROOT}/test-model_de3bba26cf36/.o_direct_probe_12.tmp"),
            format!("test-model_de3bba26cf36_r3/00a/10_g2/{hex}.bin"),
        ];
        for path in &rejected {
            assert_eq!(fm.parse_block_path(Path::new(path)), None, "{path}");
            assert_eq!(fm.parse_object_name(path), None, "{path}");
        }
    }

    #[test]
    fn temp_file_names() {
        let fm = mapper(&fixture_a(0));
        let dest = fm.block_path(&[0xab; 32], 1);
        let temp = FileMapper::temp_path(&dest, 7);
        assert_eq!(temp.parent(), dest.parent());
        assert!(path_str(&temp).ends_with(".bin_7.tmp"));
        let name = |p: &Path| p.file_name().expect("has a name").to_owned();
        assert!(FileMapper::is_temp_file_name(&name(&temp)));
        assert!(!FileMapper::is_temp_file_name(&name(&dest)));
        for other in [
            "config.json",
            ".o_direct_probe_12.tmp",
            "ab.bin_.tmp",
            "x.bin_1.tmp",
        ] {
            assert!(!FileMapper::is_temp_file_name(OsStr::new(other)), "{other}");
        }
    }

    // Contract §3: the obj tier's root is `prefix + "/"` or "", and the mapper adds another '/'.
    #[test]
    fn object_keys_keep_double_and_leading_slash() {
        let ns = fixture_a(0);
        let hash = [0, 1, 2, 3, 4, 5, 6, 7];
        assert_eq!(
            FileMapper::object_key("kv", &ns, &hash, 2),
            "kv//test-model_de3bba26cf36_r0/000/10_g2/0001020304050607.bin"
        );
        assert_eq!(
            FileMapper::object_key("", &ns, &hash, 2),
            "/test-model_de3bba26cf36_r0/000/10_g2/0001020304050607.bin"
        );
        let fm = FileMapper::for_object_store("kv", &ns);
        assert_eq!(
            fm.parse_object_name("kv//test-model_de3bba26cf36_r0/000/10_g2/0001020304050607.bin"),
            Some(make_key(&hash, 2))
        );
        assert_eq!(
            fm.parse_object_name("kv/test-model_de3bba26cf36_r0/000/10_g2/0001020304050607.bin"),
            None
        );
    }

    // vLLM joins with f-strings, so a root ending in '/' keeps '//' in the text (same directory).
    #[test]
    fn root_with_trailing_slash_is_not_normalized() {
        let fm = FileMapper::new(Path::new("/tmp/cache/"), &fixture_a(3));
        let path = fm.block_path(&[0, 1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(
            path_str(&path),
            "/tmp/cache//test-model_de3bba26cf36_r3/000/10_g2/0001020304050607.bin"
        );
        assert_eq!(
            fm.parse_block_path(&path),
            Some(make_key(&[0, 1, 2, 3, 4, 5, 6, 7], 2))
        );
        let tidy =
            Path::new("/tmp/cache/test-model_de3bba26cf36_r3/000/10_g2/0001020304050607.bin");
        assert!(fm.parse_block_path(tidy).is_some());
    }

    // Config files state only what differs from vLLM's defaults; typos are errors.
    #[test]
    fn namespace_deserializes_with_defaults() {
        let ns: Namespace = serde_json::from_value(json!({
            "model_name": "test-model",
            "dtype": "float16",
            "tokens_per_hash": 16,
            "blocks_per_file": 1,
            "kv_cache_groups": [],
        }))
        .expect("minimal namespace parses");
        assert_eq!(ns, Namespace::new("test-model", "float16", 16, 1));
        let typo = serde_json::from_value::<Namespace>(json!({
            "model_name": "m", "dtype": "d", "tokens_per_hash": 1, "blocks_per_file": 1,
            "kv_cache_groups": [], "tp": 2,
        }));
        assert!(typo.is_err());
        let back = serde_json::to_value(fixture_c()).expect("serializes");
        assert_eq!(
            serde_json::from_value::<Namespace>(back).ok(),
            Some(fixture_c())
        );
    }
}
