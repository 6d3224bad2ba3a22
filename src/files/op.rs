//! A files-layout op: one block's state machine (its kind, the step it is at, what the steps
//! have learnt: the descriptor, the paths, the crc32c, the writes), held in the worker's op
//! table and addressed by index and generation.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::job::{JobState, KeyFailure};
use crate::key::Key;
use crate::worker::{Chunks, LayoutOp, TableOp};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Open,
    /// `fgetxattr` of the block's crc32c on the ring (5.19+; else a call after the open).
    GetXattr,
    Read,
    Close,
    OpenTmp,
    /// A confined `O_PATH` open of `<hhh>`, the parent of the temp file's directory, when the
    /// temp file's directory is missing (first block there); its fd is the op's `fd` until
    /// `MkdirLeaf` completes.
    OpenParent,
    /// `mkdirat(<hhh> fd, "<hh>_g<g>")`.
    MkdirLeaf,
    /// `mkdirat` of `<hhh>` below the data directory, when it is missing too.
    MkdirParent,
    /// `fsetxattr` of the block's crc32c on the ring (5.19+; else a call after the open).
    SetXattr,
    Write,
    Sync,
    CloseTmp,
    Rename,
    UnlinkTmp,
    Unlink,
    /// `sync = "data"`: after the rename, the directory is opened, fsynced (the new name is
    /// durable; the store reports then) and closed, all on the ring.
    OpenDir,
    SyncDir,
    CloseDir,
    /// A probe's `statx` of the block path (see [`super::probe`]).
    Stat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Load,
    Store,
    /// Removing a block: an eviction, or a short/corrupt file found by a load.
    Remove,
    /// Finding out whether a block not indexed here exists (a lookup's question).
    Probe,
}

pub(crate) struct Op {
    pub kind: Kind,
    pub step: Step,
    pub job: Option<Arc<JobState>>,
    pub item: u32,
    pub key: Option<Key>,
    pub dev: u16,
    pub block: u32,
    pub fd: i32,
    pub dest: PathBuf,
    pub tmp: PathBuf,
    pub crc: Option<u32>,
    /// The writes of a store: the whole block, or chunks when loads were waiting as it started
    /// writing (so a load can overtake it). A new file is extended by each write, and
    /// extending O_DIRECT writes serialize in the file system: one write is cheapest when
    /// nothing waits.
    pub chunks: Chunks,
    /// The store failed: after closing, its temp file is removed.
    pub failed: bool,
    /// Bytes reserved in (or, for a removal, to release from) the usage counter.
    pub bytes: u64,
    /// The key's outcome has been reported; the op only cleans up now.
    pub resolved: bool,
    /// A load whose file was short or corrupt: its failure, reported once the file is
    /// removed (a caller that sees the failure finds the file gone, as vLLM's fs tier does).
    pub pending_failure: Option<(KeyFailure, String)>,
    pub mkdir_tried: bool,
    /// A store preparing (before its write): counted in `FilesLayout::stores_opening`.
    pub opening: bool,
    /// The leaf's parent `<hhh>` was made once already: a second ENOENT on the leaf (a
    /// dangling symlink at `<hhh>`, or a cleaner racing) fails the store instead of looping.
    pub mkdir_parent_tried: bool,
    pub retried: bool,
    /// The temp file exists on disk (created, not yet renamed or removed).
    pub tmp_exists: bool,
    /// A removal that first reads the file into this staging slot (demotion to S3).
    pub staging: Option<u32>,
    pub started: Instant,
    /// A probe: the generation of its question in `WorkerShared::unindexed`.
    pub generation: u64,
}

impl Op {
    /// The temp file's directory `<data>/<hhh>/<hh>_g<g>`.
    pub fn leaf_dir(&self) -> &Path {
        self.tmp.parent().unwrap_or(&self.tmp)
    }

    /// The directory a `MkdirLeaf` / `MkdirParent` / `OpenParent` step creates or opens: the
    /// leaf, or its parent `<hhh>`.
    pub fn mkdir_target(&self) -> &Path {
        let leaf = self.leaf_dir();
        match self.step {
            Step::MkdirParent | Step::OpenParent => leaf.parent().unwrap_or(leaf),
            _ => leaf,
        }
    }
}

impl TableOp for Op {
    fn clear(&mut self) {
        self.job = None;
        self.pending_failure = None;
    }
}

impl LayoutOp for Op {
    fn writing(&mut self) -> Option<&mut Chunks> {
        (self.step == Step::Write).then_some(&mut self.chunks)
    }

    fn device(&self) -> usize {
        self.dev as usize
    }
}

impl Op {
    pub fn empty() -> Op {
        Op {
            kind: Kind::Load,
            step: Step::Open,
            job: None,
            item: 0,
            key: None,
            dev: 0,
            block: 0,
            fd: -1,
            dest: PathBuf::new(),
            tmp: PathBuf::new(),
            crc: None,
            chunks: Chunks::default(),
            failed: false,
            bytes: 0,
            resolved: false,
            pending_failure: None,
            mkdir_tried: false,
            opening: false,
            mkdir_parent_tried: false,
            retried: false,
            tmp_exists: false,
            staging: None,
            started: Instant::now(),
            generation: 0,
        }
    }
}
