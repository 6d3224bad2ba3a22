//! A files-layout op: one block's state machine (its kind, the step it is at, what the steps
//! have learnt: the descriptor, the paths, the crc32c, the writes), held in the worker's op
//! table and addressed by index and generation.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::job::{JobState, KeyFailure};
use crate::key::Key;
use crate::worker::{Chunks, LayoutOp};

use super::index::Pin;

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

impl Step {
    /// Whether an op of `kind` may begin at `step`.
    pub fn first(kind: Kind, step: Step) -> bool {
        matches!(
            (kind, step),
            (Kind::Load, Step::Open)
                | (Kind::Store, Step::OpenTmp)
                | (Kind::Remove, Step::Open | Step::Unlink)
                | (Kind::Probe, Step::Stat)
        )
    }

    /// Whether an op of `kind` at this step may take step `to` next: the files layout's state
    /// machine, written in one place ([`Op::go`] checks every move against it). A load whose
    /// file turns out short or corrupt goes on as a removal from its read.
    pub fn may_go(self, kind: Kind, to: Step) -> bool {
        use Step::{
            Close, CloseDir, CloseTmp, GetXattr, MkdirLeaf, MkdirParent, Open, OpenDir, OpenParent,
            OpenTmp, Read, Rename, SetXattr, Sync, SyncDir, Unlink, UnlinkTmp, Write,
        };
        match kind {
            Kind::Load => matches!(
                (self, to),
                (Open, GetXattr | Read) | (GetXattr, Read) | (Read, Close)
            ),
            // An eviction or removal (`Unlink` at once), a demotion (read into staging first),
            // or a load's bad file (closed, then removed).
            Kind::Remove => matches!(
                (self, to),
                (Open, GetXattr | Read | Unlink)
                    | (GetXattr, Read)
                    | (Read, Close)
                    | (Close, Unlink)
            ),
            Kind::Probe => false,
            Kind::Store => matches!(
                (self, to),
                (OpenTmp, OpenParent | SetXattr | Write)
                    | (OpenParent, MkdirLeaf | MkdirParent)
                    | (MkdirParent, OpenParent)
                    | (MkdirLeaf, OpenTmp)
                    | (SetXattr, Write)
                    | (Write, Sync | CloseTmp)
                    | (Sync, CloseTmp)
                    | (CloseTmp, Rename | UnlinkTmp)
                    | (Rename, UnlinkTmp | OpenDir)
                    | (OpenDir, SyncDir)
                    | (SyncDir, CloseDir)
                    // A failure before the rename: close what is open, remove the temp file.
                    | (
                        OpenTmp | OpenParent | MkdirLeaf | MkdirParent | SetXattr | Write | Sync,
                        CloseTmp | UnlinkTmp
                    )
            ),
        }
    }
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
    /// A load's pin on the index entry whose file it reads (none for a key not indexed when
    /// it started, until it finds the file).
    pub pin: Option<Pin>,
}

impl Op {
    /// The op's first step.
    pub fn begin(&mut self, step: Step) {
        debug_assert!(
            Step::first(self.kind, step),
            "a files {:?} op cannot begin at {step:?}",
            self.kind
        );
        self.step = step;
    }

    /// The op's next step, checked against [`Step::may_go`].
    pub fn go(&mut self, to: Step) {
        debug_assert!(
            self.step.may_go(self.kind, to),
            "a files {:?} op cannot go from {:?} to {to:?}",
            self.kind,
            self.step
        );
        self.step = to;
    }

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
            chunks: Chunks::NONE,
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
            pin: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Step; 19] = [
        Step::Open,
        Step::GetXattr,
        Step::Read,
        Step::Close,
        Step::OpenTmp,
        Step::OpenParent,
        Step::MkdirLeaf,
        Step::MkdirParent,
        Step::SetXattr,
        Step::Write,
        Step::Sync,
        Step::CloseTmp,
        Step::Rename,
        Step::UnlinkTmp,
        Step::Unlink,
        Step::OpenDir,
        Step::SyncDir,
        Step::CloseDir,
        Step::Stat,
    ];
    const KINDS: [Kind; 4] = [Kind::Load, Kind::Store, Kind::Remove, Kind::Probe];

    /// Walks `path` as an op of `kind` would: a first step, then legal moves only.
    fn walk(kind: Kind, path: &[Step]) -> Op {
        let mut op = Op {
            kind,
            ..Op::empty()
        };
        op.begin(path[0]);
        for &s in &path[1..] {
            op.go(s);
        }
        op
    }

    #[test]
    fn every_path_the_layout_takes_is_legal() {
        use Step::*;
        // A load (xattr on the ring or not), and one whose file is bad: removed after closing.
        walk(Kind::Load, &[Open, GetXattr, Read, Close]);
        walk(Kind::Load, &[Open, Read, Close]);
        let mut bad = walk(Kind::Load, &[Open, Read]);
        bad.kind = Kind::Remove;
        bad.go(Close);
        bad.go(Unlink);
        // A store in a new <hhh>/<hh>_g<g> (both directories made), synced, its name made
        // durable; one in an existing directory without sync; failures at each stage.
        walk(
            Kind::Store,
            &[
                OpenTmp,
                OpenParent,
                MkdirParent,
                OpenParent,
                MkdirLeaf,
                OpenTmp,
                SetXattr,
                Write,
                Sync,
                CloseTmp,
                Rename,
                OpenDir,
                SyncDir,
                CloseDir,
            ],
        );
        walk(Kind::Store, &[OpenTmp, Write, CloseTmp, Rename]);
        walk(Kind::Store, &[OpenTmp, Write, CloseTmp, UnlinkTmp]);
        walk(
            Kind::Store,
            &[OpenTmp, OpenParent, MkdirLeaf, CloseTmp, UnlinkTmp],
        );
        walk(
            Kind::Store,
            &[OpenTmp, Write, Sync, CloseTmp, Rename, UnlinkTmp],
        );
        // An eviction, a demotion, a demotion whose open failed; a probe.
        walk(Kind::Remove, &[Unlink]);
        walk(Kind::Remove, &[Open, GetXattr, Read, Close, Unlink]);
        walk(Kind::Remove, &[Open, Unlink]);
        walk(Kind::Probe, &[Stat]);
    }

    #[test]
    fn moves_the_layout_never_makes_are_refused() {
        use Step::*;
        assert!(
            !Read.may_go(Kind::Load, Unlink),
            "a load removes only as a removal"
        );
        assert!(
            !Close.may_go(Kind::Load, Open),
            "a load does not start over"
        );
        assert!(
            !Rename.may_go(Kind::Store, CloseTmp),
            "the temp file is closed once"
        );
        assert!(!Rename.may_go(Kind::Store, Rename), "renamed once");
        assert!(
            !OpenTmp.may_go(Kind::Store, Rename),
            "no rename before the write"
        );
        assert!(
            !Write.may_go(Kind::Store, Rename),
            "closed before it is renamed"
        );
        assert!(
            !Unlink.may_go(Kind::Remove, Open),
            "a removal ends at its unlink"
        );
        assert!(
            !Step::first(Kind::Store, Write),
            "a store begins with its temp file"
        );
        assert!(
            !Step::first(Kind::Load, Read),
            "a load begins with its open"
        );
        for s in ALL {
            for t in ALL {
                assert!(!s.may_go(Kind::Probe, t), "a probe is one statx");
            }
            assert!(
                !CloseDir.may_go(Kind::Store, s),
                "a store ends at its directory's close"
            );
        }
    }

    /// Every step is the first of some kind or reached from one: the table has no step the
    /// layout could never take.
    #[test]
    fn every_step_is_reachable() {
        let mut reached: Vec<(Kind, Step)> = Vec::new();
        for k in KINDS {
            reached.extend(ALL.iter().filter(|&&s| Step::first(k, s)).map(|&s| (k, s)));
        }
        let mut i = 0;
        while i < reached.len() {
            let (k, s) = reached[i];
            for t in ALL {
                if s.may_go(k, t) && !reached.contains(&(k, t)) {
                    reached.push((k, t));
                }
            }
            i += 1;
        }
        for s in ALL {
            assert!(
                reached.iter().any(|&(_, r)| r == s),
                "{s:?} is never reached"
            );
        }
    }
}
