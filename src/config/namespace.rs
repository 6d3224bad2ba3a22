//! `[files.namespace]` (and `[s3.namespace]`): the fields of vLLM's run config that name the
//! namespace directory and the object names (`files::mapper` derives the names from them).

use serde::{Deserialize, Serialize};

/// One KV-cache group as the run config records it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KvCacheGroup {
    pub tokens_per_block: u64,
    pub layer_names: Vec<String>,
}

/// What the namespace is derived from: the fields of vLLM's `OffloadingSpec` that `FileMapper`
/// reads (contract §1.2). Values are taken as given: this type states identity, it does not judge
/// whether a configuration is sensible.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Namespace {
    /// `config.model.name`, e.g. a Hugging Face id such as `meta-llama/Llama-3.1-8B`.
    pub model_name: String,
    /// `config.model.dtype` as vLLM prints it, e.g. `"bfloat16"`.
    pub dtype: String,
    /// `config.cache.tokens_per_hash` (the resolved hash granularity).
    pub tokens_per_hash: u64,
    /// `blocks_per_chunk`: one file holds one chunk.
    pub blocks_per_file: u64,
    #[serde(default = "one")]
    pub tp_size: u64,
    #[serde(default = "one")]
    pub pp_size: u64,
    #[serde(default = "one")]
    pub pcp_size: u64,
    #[serde(default = "one")]
    pub dcp_size: u64,
    /// `config.parallel.rank`; 0 on the scheduler side, where vLLM's tiers run.
    #[serde(default)]
    pub rank: u64,
    /// `config.groups`, in group-index order.
    pub kv_cache_groups: Vec<KvCacheGroup>,
    /// `config.parallel.is_parallelism_agnostic`.
    #[serde(default)]
    pub parallel_agnostic: bool,
    /// `config.replicated_layout`.
    #[serde(default)]
    pub replicated_layout: bool,
    /// `canonical_format_id(kv_cache_layout)` when `config.canonical_layout` is on, e.g.
    /// `"v1-nhd"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canonical_format: Option<String>,
}

fn one() -> u64 {
    1
}

impl Namespace {
    /// A namespace with vLLM's defaults: every parallel size 1, rank 0, no groups, no flags.
    pub fn new(
        model_name: impl Into<String>,
        dtype: impl Into<String>,
        tokens_per_hash: u64,
        blocks_per_file: u64,
    ) -> Namespace {
        Namespace {
            model_name: model_name.into(),
            dtype: dtype.into(),
            tokens_per_hash,
            blocks_per_file,
            tp_size: 1,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            rank: 0,
            kv_cache_groups: Vec::new(),
            parallel_agnostic: false,
            replicated_layout: false,
            canonical_format: None,
        }
    }
}
