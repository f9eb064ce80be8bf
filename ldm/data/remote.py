"""Shards and filelists behind URLs: `s3://`, `gs://`, `hdfs://`, `http(s)://`, `file://`, `memory://`, …

fsspec opens them and reads them in blocks (a shard is streamed, never downloaded whole first).
Credentials come from each store's usual environment and config files, as fsspec's backends find them;
no flag takes one. Any other option of a backend is an `FSSPEC_<PROTOCOL>_<OPTION>` variable (docs/data-formats.md).
What fsspec does not do is retry: a dropped connection or an HTTP 5xx in the middle
of a multi-gigabyte shard would cost the rest of it. `RetryingReader` reopens the URL where the read
stopped, with backoff, and gives up with an `OSError` after `ATTEMPTS` tries; a URL that does not exist
raises `FileNotFoundError` at once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import time

ATTEMPTS = 4
BACKOFF_SECONDS = 1.0  # doubled after each failed attempt
BLOCK_SIZE = 8 << 20  # bytes per ranged request

# Backends that are not part of fsspec itself, by URL scheme: what `pip install` makes a scheme work.
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hdfs": "pyarrow", "http": "aiohttp",
            "https": "aiohttp", "az": "adlfs", "abfs": "adlfs", "oss": "ossfs", "bos": "bosfs"}

logger = logging.getLogger("ldm.data")

# Never retried: the answer will not change. A programming error (a TypeError from a backend handed an argument
# it does not take) is not a network failure either.
PERMANENT = (PermissionError, IsADirectoryError, NotADirectoryError, TypeError, AttributeError, NameError,
             ImportError, NotImplementedError, AssertionError)


class StoreRefused(OSError):
    """The store refuses the request and will refuse it again: a bucket that does not exist, missing or wrong
    credentials, access denied. Never retried; at start it ends the run (a typo in a bucket's name would otherwise
    cost every shard its retries). `reason`: the store's answer."""

    def __init__(self, what: str, reason: str = "", whole_store: bool = False):
        super().__init__(f"{what}: the store refuses it ({reason})" if reason else what)
        self.what, self.reason, self.whole_store = what, reason, whole_store

    def __reduce__(self):  # crosses ranks and worker queues as it is
        return type(self), (self.what, self.reason, self.whole_store)


# Error codes of S3's API (and of the stores that speak it) that no retry changes. The first set refuses every
# object of the store alike (a misspelled bucket, wrong keys); the second may be one object's (a missing key reads
# as 403 without the right to list the bucket, a policy may deny one prefix).
WHOLE_STORE = {"NoSuchBucket", "InvalidBucketName", "InvalidAccessKeyId", "SignatureDoesNotMatch",
               "AllAccessDisabled", "AccountProblem", "ExpiredToken", "AuthorizationHeaderMalformed",
               "InvalidSecurity", "NotSignedUp"}
ONE_OBJECT = {"AccessDenied"}  # and a bare 401/403 (below)
# botocore's credential errors, by name: raised before any request, so no answer code
CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                     "UnauthorizedSSOTokenError", "ProfileNotFound", "InvalidConfigError"}


def _error_code(error: BaseException | None) -> str | None:
    response = getattr(error, "response", None)  # botocore's ClientError
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def refusal(error: BaseException) -> tuple[str, bool] | None:
    """What a store's lasting refusal says (`Code: message`) and whether it refuses the whole store alike, or None
    when `error` is not one."""
    for e in (error, error.__cause__):
        if e is None:
            continue
        if type(e).__name__ in CREDENTIAL_ERRORS:
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no credentials'}", True
        code = _error_code(e)
        if code in ("401", "403"):  # the answer to a HEAD request has no body to say more
            return f"{code} Forbidden: the credentials are wrong or may not read it", False
        if code in WHOLE_STORE or code in ONE_OBJECT:
            return f"{code}: {str(e).splitlines()[0][:200]}", code in WHOLE_STORE
    if isinstance(error, PermissionError):
        return f"PermissionError: {str(error).splitlines()[0][:200] if str(error) else 'access denied'}", False
    return None


def bucket(url: str) -> str:
    """`scheme://bucket` of a URL (its host, for HTTP)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    return f"{scheme(url)}://{rest.split('/', 1)[0]}"


def really_missing(error: FileNotFoundError) -> bool:
    """Whether a FileNotFoundError from fsspec means the file is not there. fsspec's HTTP backend raises
    it for any failure to look a file up (a 503, a refused connection), with the real error as its cause:
    only a 404/410 answer, or no cause at all, is a missing file; the rest is retried."""
    cause = error.__cause__
    if cause is None:
        return True
    status = getattr(cause, "status", None) or getattr(cause, "status_code", None)
    if status is None:  # botocore's ClientError carries its answer in .response
        response = getattr(cause, "response", None)
        status = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return str(status) in ("404", "410", "NoSuchKey")


_fork_safe = False


def _fsspec():
    """fsspec, made safe to use in a process forked after this one used it (loader workers are). Its async
    backends (HTTP, S3, GCS) run on an IO thread that a forked child does not have; fsspec leaves the reset
    to its users (HF datasets calls it in its workers), and without it the child's first read hangs."""
    global _fork_safe
    import fsspec
    import fsspec.asyn

    if not _fork_safe:
        os.register_at_fork(after_in_child=fsspec.asyn.reset_lock)
        # storage options from FSSPEC_<PROTOCOL>_<OPTION> variables (FSSPEC_GCS_TOKEN=anon, ...): fsspec reads them
        # when it is imported, which may be before this process's environment was final (a fork server's child)
        fsspec.config.set_conf_env(fsspec.config.conf)
        _fork_safe = True
    return fsspec


def is_url(path: str) -> bool:
    return "://" in path


def scheme(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join(base_url: str, relative: str) -> str:
    """`relative` resolved against the folder of `base_url`."""
    return posixpath.join(posixpath.dirname(base_url), relative)


def check_scheme(url: str) -> None:
    """Raise ValueError naming the package to install when this process cannot open `url`'s scheme."""
    fsspec = _fsspec()
    name = scheme(url)
    try:
        fsspec.get_filesystem_class(name)
    except (ImportError, ValueError) as e:
        package = PACKAGES.get(name)
        hint = f": pip install {package}" if package else ""
        raise ValueError(f"{name}:// URLs cannot be read here ({str(e).splitlines()[0]}){hint}") from None


def describe(error: BaseException) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


def _retrying(what: str, action, attempts: int | None = None):
    """`action()`, retried with backoff on anything but a permanent error or a missing file; OSError after
    the last of `attempts` (default ATTEMPTS) tries."""
    attempts = attempts or ATTEMPTS
    problem = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1))
        try:
            return action()
        except Exception as e:  # noqa: BLE001 - sorted below
            refused = refusal(e)
            if refused is not None:
                raise StoreRefused(what, *refused) from e
            if isinstance(e, PERMANENT) or isinstance(e, FileNotFoundError) and really_missing(e):
                raise
            problem = describe(e.__cause__ if isinstance(e, FileNotFoundError) else e)
        logger.debug("%s failed (attempt %d of %d): %s", what, attempt + 1, attempts, problem)
    raise OSError(f"{what} failed {attempts} times ({problem})")


class RetryingReader(io.RawIOBase):
    """A read-only file of one URL that survives broken connections: each failed read reopens the URL
    and continues at the byte where it stopped. Seekable where the store serves byte ranges (a parquet's
    footer, then its row groups, is read this way); a seek only moves the position, the next read goes there."""

    def __init__(self, url: str):
        self.url = url
        self.position = 0
        self._file = None
        _retrying(f"opening {url}", self._open)

    def _open(self):
        fsspec = _fsspec()
        self._close_file()
        # block_size goes to the file, not to `fsspec.open`: that hands extra arguments to the filesystem's
        # constructor, which HTTP's accepts and S3's rejects
        fs, path = fsspec.core.url_to_fs(self.url)
        f = fs.open(path, "rb", block_size=BLOCK_SIZE)
        try:
            if self.position and not self._seek(f):  # a stream without ranges: read up to where we were
                left = self.position
                while left:
                    skipped = len(f.read(min(left, BLOCK_SIZE)))
                    if not skipped:
                        raise EOFError(f"{self.url} is shorter than before ({self.position - left} bytes)")
                    left -= skipped
        except BaseException:
            f.close()
            raise
        self._file = f

    def _seek(self, f) -> bool:
        """Move a reopened file to where the read stopped; False when it cannot (fsspec's HTTP stream
        says it is seekable and then raises)."""
        if not f.seekable():
            return False
        try:
            f.seek(self.position)
        except (ValueError, io.UnsupportedOperation):
            return False
        return True

    def _read(self, size: int) -> bytes:
        if self._file is None:
            self._open()
        try:
            if self._file.tell() != self.position and not self._seek(self._file):
                self._open()  # a stream that cannot seek: reopened and read up to the position
            return self._file.read(size)
        except BaseException:
            self._close_file()  # the next attempt reopens at self.position
            raise

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            offset += self.size()
        elif whence == io.SEEK_CUR:
            offset += self.position
        if offset < 0:
            raise ValueError(f"negative seek position {offset} in {self.url}")
        self.position = offset
        return self.position

    def size(self) -> int:
        """The file's size in bytes (the store's answer, asked again on a failure like a read)."""
        def ask() -> int:
            if self._file is None:
                self._open()
            size = getattr(self._file, "size", None)
            return int(size) if size is not None else _fsspec().filesystem(scheme(self.url)).size(self.url)

        return _retrying(f"asking the size of {self.url}", ask)

    def read(self, size: int = -1) -> bytes:
        data = _retrying(f"reading {self.url} at byte {self.position}", lambda: self._read(size))
        self.position += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped anyway
                self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()
        super().close()


def open_url(url: str) -> RetryingReader:
    """A binary stream of `url`; FileNotFoundError when it does not exist, OSError when it cannot be read."""
    return RetryingReader(url)


def read_text(url: str) -> str:
    """A small text file (a filelist) at `url`."""
    with open_url(url) as f:
        return f.read().decode("utf-8")


def exists(url: str) -> bool:
    """Whether `url` is there, asked once (a start-up check: the reads retry). OSError when the store does
    not answer: fsspec's own `exists` says False for a 503 or a refused connection."""
    fsspec = _fsspec()
    fs, path = fsspec.core.url_to_fs(url)
    try:
        _retrying(f"looking for {url}", lambda: fs.info(path), attempts=1)
    except FileNotFoundError:  # really missing: anything else arrives as an OSError
        return False
    return True


def glob(pattern: str) -> list[str]:
    """The files matching a glob URL, or the files in a folder URL, as URLs (retried like a read)."""
    fsspec = _fsspec()
    fs, path = fsspec.core.url_to_fs(pattern)

    def listing() -> list[str]:
        if fs.isdir(path):
            return [entry["name"] for entry in fs.ls(path, detail=True) if entry["type"] == "file"]
        return [name for name, entry in fs.glob(path, detail=True).items() if entry.get("type") == "file"]

    return sorted(fs.unstrip_protocol(p) for p in _retrying(f"listing {pattern}", listing))
