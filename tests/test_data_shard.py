import gzip
import zlib

import pytest
from corpus import gzip_lines

from ldm.data.filelist import FileListError, Shard, read_file_list
from ldm.data.shard import ShardError, ShardTruncated, iter_lines

LINES = [b"caption %d\t_\t%s" % (i, b"x" * (i * 997 % 5000)) for i in range(400)]


def test_gzip_and_plain_read_the_same_lines_whatever_the_name(tmp_path):
    gzip_lines(tmp_path / "a.txt", LINES)  # gzip content, misleading name
    (tmp_path / "b.gz").write_bytes(b"\n".join(LINES) + b"\n")  # plain text named .gz
    assert list(iter_lines(str(tmp_path / "a.txt"))) == LINES
    assert list(iter_lines(str(tmp_path / "b.gz"))) == LINES


def test_crlf_and_final_line_without_newline(tmp_path):
    (tmp_path / "s").write_bytes(b"a\t_\tx\r\nb\t_\ty")
    assert list(iter_lines(str(tmp_path / "s"))) == [b"a\t_\tx", b"b\t_\ty"]


def test_multi_member_gzip(tmp_path):
    path = tmp_path / "m.gz"
    path.write_bytes(gzip.compress(b"\n".join(LINES[:10]) + b"\n") + gzip.compress(b"\n".join(LINES[10:]) + b"\n"))
    assert list(iter_lines(str(path))) == LINES


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_truncated_gzip_keeps_every_complete_line_before_the_break(tmp_path, keep):
    full = gzip.compress(b"\n".join(LINES) + b"\n")
    path = tmp_path / "t.gz"
    path.write_bytes(full[: int(len(full) * keep)])
    got = []
    with pytest.raises(ShardTruncated):
        for line in iter_lines(str(path)):
            got.append(line)
    # every line returned is a complete one, in order, and nothing the decompressor produced is lost
    assert got == LINES[: len(got)]
    produced = zlib.decompressobj(31).decompress(full[: int(len(full) * keep)])
    assert len(got) == produced.count(b"\n")


def test_missing_shard_is_a_shard_error(tmp_path):
    with pytest.raises(ShardError, match="not found"):
        list(iter_lines(str(tmp_path / "nope.gz")))


def test_file_list_weights_and_relative_paths(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.filelist").write_text("s1.gz\n# comment\n\n/abs/s2.gz\n")
    (tmp_path / "b.filelist").write_text("s3.gz\n")
    (tmp_path / "list").write_text("sub/a.filelist 2.5\nb.filelist\n")
    monkeypatch.chdir("/")
    shards = read_file_list(str(tmp_path / "list"))
    assert shards == [
        Shard(str(tmp_path / "sub" / "s1.gz"), 2.5),
        Shard("/abs/s2.gz", 2.5),
        Shard(str(tmp_path / "s3.gz"), 1.0),
    ]


@pytest.mark.parametrize("content, message", [
    ("a.filelist x\n", "not a number"),
    ("a.filelist 0\n", "positive"),
    ("a.filelist 1 2\n", "expected"),
    ("missing.filelist\n", "not found"),
    ("", "no shards"),
])
def test_file_list_errors_are_readable(tmp_path, content, message):
    (tmp_path / "a.filelist").write_text("s.gz\n")
    (tmp_path / "list").write_text(content)
    with pytest.raises(FileListError, match=message):
        read_file_list(str(tmp_path / "list"))


def test_shipped_file_list_resolves_from_the_repository_root(monkeypatch):
    from conftest import ROOT

    monkeypatch.chdir(ROOT)
    shards = read_file_list("./data/filelist/train.filelist.list")
    assert [s.path for s in shards] == [f"/data/laion400m/part-{i:05d}.gz" for i in range(10)]


def test_an_entry_that_names_two_different_files_is_refused_naming_both(tmp_path, monkeypatch):
    """synth writes shapes.filelist and shapes-00000.gz into every corpus: run from inside c1 with c2's list, the
    relative entry exists both from the current directory and beside the list."""
    for corpus in ("c1", "c2"):
        (tmp_path / corpus).mkdir()
        gzip_lines(str(tmp_path / corpus / "shapes-00000.gz"), [corpus.encode()])
        (tmp_path / corpus / "shapes.filelist").write_text("shapes-00000.gz\n")
        (tmp_path / corpus / "shapes.filelist.list").write_text("shapes.filelist\n")
    monkeypatch.chdir(tmp_path / "c1")
    with pytest.raises(FileListError, match=rf"which is both {tmp_path / 'c1'}/shapes.filelist .* and "
                                            rf"{tmp_path / 'c2'}/shapes.filelist"):
        read_file_list(str(tmp_path / "c2" / "shapes.filelist.list"))
    assert [s.path for s in read_file_list("shapes.filelist.list")] == ["shapes-00000.gz"]  # the same file: fine


def test_a_list_or_filelist_naming_something_twice_is_refused_and_a_byte_order_mark_is_ignored(tmp_path):
    (tmp_path / "a.filelist").write_text("\ufeffs1.gz\ns2.gz\n", encoding="utf-8")
    (tmp_path / "list").write_text("\ufeffa.filelist\n", encoding="utf-8")
    assert [s.path for s in read_file_list(str(tmp_path / "list"))] == [str(tmp_path / "s1.gz"),
                                                                         str(tmp_path / "s2.gz")]
    (tmp_path / "twice.list").write_text("a.filelist\n./a.filelist\n")
    with pytest.raises(FileListError, match=r"twice.list:2 names ./a.filelist again \(line 1\).*weight"):
        read_file_list(str(tmp_path / "twice.list"))
    (tmp_path / "b.filelist").write_text("s1.gz\ns2.gz\ns1.gz\n")
    (tmp_path / "b.list").write_text("b.filelist\n")
    with pytest.raises(FileListError, match=r"b.filelist:3 names s1.gz again \(line 1\)"):
        read_file_list(str(tmp_path / "b.list"))


def test_a_shard_given_as_the_list_of_filelists_says_what_it_is(tmp_path):
    gzip_lines(str(tmp_path / "s.gz"), [b"x"])
    (tmp_path / "s.filelist").write_text("s.gz\n")
    with pytest.raises(FileListError, match="is a gzipped shard, not a list of paths: --file_list takes a list"):
        read_file_list(str(tmp_path / "s.filelist"))
