"""A FUSE file system for tests: a passthrough of a directory whose reads of chosen file
names fail with EIO, as a FUSE or network file system does when its server fails.

Run as ``python failing_fs.py ROOT MOUNTPOINT [NAME ...]`` (root, /dev/fuse, ``mfusepy`` over
libfuse3); serves in the foreground until unmounted. Files named NAME (default
``.kvtier-usage``) answer reads with EIO, all of them, or all but the first
``$FAILING_FS_READS_OK``; everything else passes through to ROOT. With
``FAILING_FS_DIRECT_IO=1`` every read reaches the server (no page cache; no shared mappings
either), so a read after the first can fail too.
"""

from __future__ import annotations

import errno
import os
import sys

import mfusepy as fuse

_STAT = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns",
         "st_ctime_ns")
_STATVFS = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")


class FailingReads(fuse.Operations):
    use_ns = True

    def __init__(self, root: str, fail: set[str], reads_ok: int) -> None:
        self.root = root
        self.fail = fail
        self.reads_ok = reads_ok

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path, fh=None):
        st = os.lstat(self._p(path))
        return {k: getattr(st, k) for k in _STAT}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._p(path))]

    def open(self, path, flags):
        return os.open(self._p(path), flags & ~os.O_DIRECT)

    def create(self, path, mode, fi=None):
        return os.open(self._p(path), os.O_CREAT | os.O_RDWR, mode)

    def read(self, path, size, offset, fh):
        if os.path.basename(path) in self.fail:
            if self.reads_ok <= 0:
                raise fuse.FuseOSError(errno.EIO)
            self.reads_ok -= 1
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        os.truncate(self._p(path), length)

    def release(self, path, fh):
        os.close(fh)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)

    def mkdir(self, path, mode):
        os.mkdir(self._p(path), mode)

    def rmdir(self, path):
        os.rmdir(self._p(path))

    def unlink(self, path):
        os.unlink(self._p(path))

    def rename(self, old, new):
        os.rename(self._p(old), self._p(new))

    def link(self, target, source):
        os.link(self._p(source), self._p(target))

    def chmod(self, path, mode):
        os.chmod(self._p(path), mode)

    def utimens(self, path, times=None):
        os.utime(self._p(path), ns=times)

    def statfs(self, path):
        s = os.statvfs(self._p(path))
        return {k: getattr(s, k) for k in _STATVFS}


if __name__ == "__main__":
    root, mountpoint, *names = sys.argv[1:]
    reads_ok = int(os.environ.get("FAILING_FS_READS_OK", "0"))
    fuse.FUSE(FailingReads(root, set(names) or {".kvtier-usage"}, reads_ok), mountpoint,
              foreground=True, nothreads=True,
              direct_io=os.environ.get("FAILING_FS_DIRECT_IO") == "1")
