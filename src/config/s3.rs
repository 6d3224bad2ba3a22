//! `[s3]`: the object-store tier's settings, and the credentials that never print.

use super::raw::RawS3;
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;

/// A credential from the config: kept for the client, shown as `"<redacted>"` by `Debug` and
/// when the config is printed, so it never reaches a log.
#[derive(Clone, PartialEq, Eq, Deserialize)]
pub struct Secret(pub(super) String);

impl Secret {
    #[must_use]
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the S3 client only.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("<redacted>")
    }
}

/// `[s3] write`: when stored blocks go to the object store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum S3Write {
    /// Every stored block is uploaded after its NVMe store.
    Through,
    /// Blocks the NVMe tier evicts are uploaded: read into a staging buffer before their slot is
    /// reused (slab) or their file removed (files).
    OnEvict,
    /// Nothing is uploaded: the bucket is read-only for this node.
    #[default]
    Off,
}

/// `[s3] write_ack`: when a write-through store job is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteAck {
    /// After both the NVMe store and the upload finished; the job fails if either failed.
    #[default]
    Both,
    /// After the NVMe store and a copy of the block for the upload; the upload finishes in the
    /// background (failures are counted and logged, not reported in the job). A block finding
    /// `upload_queue_blocks` copies waiting is not uploaded (counted): stores never wait for S3.
    Nvme,
}

/// `[s3]`: an S3-compatible object store behind the NVMe tier.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawS3")]
pub struct S3Config {
    pub bucket: String,
    /// `http(s)://host:port` for S3-compatible stores; `None` for AWS itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    pub region: String,
    /// Path-style URLs (`endpoint/bucket/key`), which most S3-compatible servers need.
    pub force_path_style: bool,
    /// Static credentials; all three absent means the AWS default chain (env, profile, IMDS...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_key_id: Option<Secret>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_access_key: Option<Secret>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_token: Option<Secret>,
    /// Object names are `<prefix>/<files-layout relative path>`, the prefix used verbatim (an
    /// empty prefix gives no leading slash; vLLM's prefix `P` is kvtier's `"P/"`).
    pub prefix: String,
    /// Requests in flight at once (GET, HEAD and PUT together).
    pub max_concurrency: usize,
    /// Per attempt: connect plus response, and the whole body for GET and PUT.
    pub timeout_ms: u64,
    /// Retries after the first attempt, for timeouts, connection errors, 5xx and throttling.
    pub retries: u32,
    pub write: S3Write,
    pub write_ack: WriteAck,
    /// Store a block loaded from S3 into NVMe too (the load reports once that store is done).
    pub promote_on_load: bool,
    /// Bound of the lookup cache (keys whose presence in the bucket is known or being asked).
    pub lookup_cache_max: usize,
    /// How long a HEAD's answer is trusted before the key is asked again (other nodes upload,
    /// lifecycle rules delete).
    pub lookup_ttl_ms: u64,
    /// Bound of blocks copied and waiting for upload (`write_ack = "nvme"` and demotions).
    pub upload_queue_blocks: usize,
    /// Namespace for object names; defaults to `[files.namespace]`.
    pub namespace: crate::config::Namespace,
}
