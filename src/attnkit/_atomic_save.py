"""Replacing a set of files in a directory so that an interrupt leaves the old set or the new one.

`replace_files(directory, writers)` writes every new file aside, in a hidden staging directory inside
`directory` (the same filesystem, so a rename is atomic), then commits with one `os.replace` per file,
keeping a hard link to each old file until all are in place. docs/decisions.md item 23 lists the crash
windows:

- while writing (nearly all the time): the old files are untouched; an exception or Ctrl-C removes the
  staging directory, a SIGKILL leaves it (`.attnkit-new-*`, hidden) beside the old files;
- during the commit (a few renames): SIGINT, SIGTERM and SIGHUP are held until it ends, and any
  exception rolls back to the old files; only a SIGKILL or a power cut in that window can leave some
  files new and some old, and then the old ones remain in `.attnkit-old-*` (a torn pair of a saved
  translator is refused at load: translator.json holds model.keras's SHA-256).

The directory itself is not swapped: it may hold the user's other files (or be "."), which stay as they
are. `replace_tree` does the same for a tree of files (a model directory with sub-folders), and removes
the caller's own files that the new set no longer holds (docs/decisions.md item 111).
"""

import contextlib
import errno
import hashlib
import os
import shutil
import signal
import tempfile
import threading

from attnkit._interrupts import raise_if_pressed

STAGING_PREFIX, BACKUP_PREFIX, PROBE_PREFIX = ".attnkit-new-", ".attnkit-old-", ".attnkit-probe-"


def file_sha256(path):
    """The SHA-256 of the file at `path` (64 hex digits), read in 1 MiB blocks: what a saved file is
    checked against (the translator's model.keras; a fine-tuning run's training file on --resume)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_replaceable(directory, names):
    """Raises ValueError if an existing `directory/name` is not a regular file (a directory, a symbolic
    link, a device, a FIFO, a socket), or if a folder on the way to it (`name` may be a relative path
    such as "1_Pooling/config.json") is not a real directory: replacing it would destroy or bypass
    something that is not ours."""
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = os.path.join(directory, *parts[:depth])
            if os.path.lexists(folder) and (os.path.islink(folder) or not os.path.isdir(folder)):
                kind = "a symbolic link" if os.path.islink(folder) else "not a directory"
                raise ValueError(f"{folder} is {kind}; attnkit writes {name} only into a directory of its own there")
        path = os.path.join(directory, *parts)
        if not os.path.lexists(path):
            continue
        if os.path.islink(path):
            kind = "a symbolic link"
        elif os.path.isdir(path):
            kind = "a directory"
        elif not os.path.isfile(path):
            kind = "a special file"
        else:
            continue
        raise ValueError(f"{path} is {kind}, not a file attnkit wrote; remove it or choose another directory")


@contextlib.contextmanager
def naming(path):
    """Within the block, an OSError that names no file ("[Errno 28] No space left on device" from a
    write) is raised again naming `path`, the file the user asked for (docs/decisions.md item 114)."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.filename2 is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or str(e), os.fspath(path)) from e
        raise


def probe_writable(directory):
    """Creates `directory` (and its missing parents) and proves a file can be created, written and
    removed there. Returns the directories it created, outermost first, so a caller that fails later
    can remove them (`remove_created`).

    Raises:
        OSError: the directory cannot be created, or a file cannot be written there (a read-only or
            special filesystem, no permission, no space), with the reason.
    """
    created, missing = [], os.path.abspath(directory)
    while not os.path.lexists(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    created.reverse()
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"attnkit")
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.remove(probe)
    except OSError:
        remove_created(created)
        raise
    return created


def remove_created(created):
    """Removes the directories `probe_writable` created, innermost first, each only if still empty."""
    for path in reversed(created):
        try:
            os.rmdir(path)
        except OSError:
            return


def replace_files(directory, writers):
    """Writes `directory/name` for every `name: write` of `writers` (`write(path)` writes one file), all
    or none: see the module docstring. Files are written in the order given, so a writer may read the
    files written before it (in the staging directory, `os.path.dirname(path)`).

    Raises:
        ValueError: an existing target that is not a regular file (`check_replaceable`).
        OSError: a file that cannot be written; the old files are left as they were.
    """
    check_replaceable(directory, writers)
    os.makedirs(directory, exist_ok=True)
    staging = None
    try:
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory)
        for name, write in writers.items():
            path = os.path.join(staging, name)
            with naming(os.path.join(directory, name)):
                write(path)
                _fsync(path)
        with naming(directory):
            _fsync(staging, directory=True)
        with _signals_held(), naming(directory):
            raise_if_pressed()  # a Ctrl-C whose KeyboardInterrupt was lost: the old files stay
            _commit(directory, staging, list(writers))
    finally:
        if staging is not None:
            with _signals_held():  # a second Ctrl-C must not leave half the staging directory
                shutil.rmtree(staging, ignore_errors=True)


def replace_tree(directory, write, remove=()):
    """Writes into `directory` every file that `write(staging)` creates under the directory it is given
    (sub-folders kept), and removes the files `remove` (paths relative to `directory`, those of the
    caller's own kind, such as an earlier save's weights) that the new set does not hold; all or none,
    as `replace_files`. Every other file in `directory` is left as it is. Returns the paths written.

    Raises:
        ValueError: an existing target that is not a regular file, or a folder on its way that is not a
            directory (`check_replaceable`).
        OSError: a file that cannot be written; the old files are left as they were.
    """
    os.makedirs(directory, exist_ok=True)
    staging = None
    try:
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory)
        with naming(directory):
            write(staging)
        names = sorted(_files_under(staging))
        removed = sorted({os.path.normpath(r).replace(os.sep, "/") for r in remove} - set(names))
        removed = [r for r in removed if os.path.isfile(os.path.join(directory, r))]
        check_replaceable(directory, names + removed)
        for name in names:
            with naming(os.path.join(directory, name)):
                _fsync(os.path.join(staging, name))
        with naming(directory):
            for folder in sorted({os.path.dirname(n) for n in names}, reverse=True):
                _fsync(os.path.join(staging, folder), directory=True)
        with _signals_held(), naming(directory):
            raise_if_pressed()  # a Ctrl-C whose KeyboardInterrupt was lost: the old files stay
            _commit(directory, staging, names, removed)
        for folder in sorted({os.path.dirname(r) for r in removed if "/" in r}, reverse=True):
            with contextlib.suppress(OSError):  # a folder emptied of the old files; one holding others stays
                os.rmdir(os.path.join(directory, folder))
        return names
    finally:
        if staging is not None:
            with _signals_held():
                shutil.rmtree(staging, ignore_errors=True)


def _files_under(root):
    """The relative paths ("a/b.json") of the regular files under `root`."""
    found = []
    for folder, _, files in os.walk(root):
        relative = os.path.relpath(folder, root)
        found += [name if relative == "." else f"{relative.replace(os.sep, '/')}/{name}" for name in files]
    return found


def _commit(directory, staging, names, removed=()):
    backup = tempfile.mkdtemp(prefix=BACKUP_PREFIX, dir=directory)
    replaced, created = [], []  # (name, whether an old file was there), in commit order; new folders
    try:
        for name in names:
            target = os.path.join(directory, name)
            created += _make_parents(directory, name)
            had_old = os.path.lexists(target)
            if had_old:
                os.makedirs(os.path.dirname(os.path.join(backup, name)), exist_ok=True)
                _keep(target, os.path.join(backup, name))
            os.replace(os.path.join(staging, name), target)
            replaced.append((name, had_old))
        for name in removed:  # moved aside, so a failure puts them back
            os.makedirs(os.path.dirname(os.path.join(backup, name)), exist_ok=True)
            os.replace(os.path.join(directory, name), os.path.join(backup, name))
            replaced.append((name, None))
        _fsync(directory, directory=True)
    except BaseException as error:
        try:
            for name, had_old in reversed(replaced):
                target = os.path.join(directory, name)
                if had_old is None or had_old:
                    os.replace(os.path.join(backup, name), target)
                else:
                    os.remove(target)
            for folder in reversed(created):
                os.rmdir(folder)
        except OSError as rollback:
            # Keep the backup: it holds the only copy of the old files not yet put back.
            raise OSError(
                f"saving into {directory} failed ({error or type(error).__name__}) and so did restoring the "
                f"previous files ({rollback}); they are in {backup}"
            ) from error
        shutil.rmtree(backup, ignore_errors=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _make_parents(directory, name):
    """Creates the folders of `directory/name` that are missing; returns them, outermost first."""
    made, parts = [], name.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        folder = os.path.join(directory, *parts[:depth])
        if not os.path.isdir(folder):
            os.mkdir(folder)
            made.append(folder)
    return made


_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV}


def _keep(path, backup):
    """A second name for the old file `path`, so it survives its replacement until the commit ends."""
    try:
        os.link(path, backup)
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
        shutil.copy2(path, backup)


def _fsync(path, directory=False):
    """Flushes a file's data, or a directory's entries, to the disk. A failure is an error, but for a
    directory on a filesystem that does not support it (EINVAL, ENOTSUP)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (directory and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_held():
    """Holds SIGINT, SIGTERM and SIGHUP (delivered when the block ends) where the OS allows it."""
    held = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)}
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
