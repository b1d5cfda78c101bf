#!/usr/bin/env python3
"""prepare_data.py: the worker behind `strata data prepare` (run that command; it finds this
script and the Python that has the Hugging Face libraries, and passes the tokenizer's hash).

Reads JSONL or parquet rows in the three dataset shapes TRL uses, tokenizes them with the model
directory's own tokenizer (tokenizer.json, tokenizer_config.json and the chat template, through
`transformers.AutoTokenizer`, so that the ids are exactly transformers'), and writes a Strata token
container (docs/formats.md, "Prepared token data"): the token ids, a loss mask (1: the token is
trained as a target), the document boundaries, and the tokenizer's hash.

Shapes (--format auto picks by the first row's keys):
  text                 {"text": "..."}: language modelling; every token trained; EOS appended.
  messages             {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}:
                       rendered with the model's chat template; only assistant turns trained
                       (--train-on-prompt: everything).
  prompt-completion    {"prompt": ..., "completion": ...}: plain strings (EOS appended to the
                       completion) or conversational (lists of messages, rendered with the
                       template); only the completion trained (--train-on-prompt: everything).

An assistant turn's tokens are found by rendering: the conversation up to the turn with the
generation prompt, and up to the end of the turn; the characters in between are the turn's,
and a token is trained when it starts inside them (offset mapping of the fast tokenizer). The
whole conversation is tokenized once, as apply_chat_template(tokenize=True) does.

Errors name the file and the line (a JSONL line, or a parquet row number); --skip-bad counts
and reports bad rows instead. Output is written under a temporary name and renamed: a failed
run leaves nothing behind. Deterministic: the same input, tokenizer and flags give the same bytes.
"""
import argparse
import json
import multiprocessing as mp
import os
import struct
import sys
import time

MAGIC = b"STRATATK"
VERSION = 1
ALIGN = 64
ROLES = ("system", "user", "assistant", "tool")

_tok = None
_opts = None


def fail(msg):
    print(f"strata data prepare: error: {msg}", file=sys.stderr)
    sys.exit(2)


class BadRow(Exception):
    pass


def init_worker(model, opts):
    global _tok, _opts
    import transformers
    transformers.utils.logging.set_verbosity_error()
    _tok = transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
    _opts = opts


def check_messages(messages, where):
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"{where} is not a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadRow(f"{where}[{i}] is not a {{\"role\", \"content\"}} object")
        if m["role"] not in ROLES:
            raise BadRow(f"{where}[{i}] has an unknown role {m['role']!r} (expected one of "
                         f"{', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise BadRow(f"{where}[{i}].content is not a string")


def render(messages, **kw):
    try:
        return _tok.apply_chat_template(messages, tokenize=False, **kw)
    except Exception as e:  # jinja's TemplateError and the template's own raise_exception
        raise BadRow(f"the chat template failed: {e}")


def encode(text):
    enc = _tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


def mask_spans(offsets, spans):
    """1 for each token that starts inside one of the character spans."""
    out = []
    for (start, _end) in offsets:
        out.append(1 if any(a <= start < b for a, b in spans) else 0)
    return out


def eos_id():
    if _tok.eos_token_id is None:
        raise BadRow("the tokenizer has no EOS token to end a document with")
    return _tok.eos_token_id


def conversation(messages, train_all, first_trained=0):
    """ids and mask of a rendered conversation; assistant turns from `first_trained` on trained."""
    text = render(messages)
    ids, offsets = encode(text)
    if train_all:
        return ids, [1] * len(ids)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first_trained:
            continue
        before = render(messages[:i], add_generation_prompt=True) if i > 0 else ""
        through = render(messages[:i + 1])
        if not text.startswith(before) or not text.startswith(through) or \
                not through.startswith(before):
            raise BadRow("the chat template does not render the conversation as a growing prefix "
                         "(its assistant turns cannot be told from the prompt); use "
                         "--train-on-prompt")
        spans.append((len(before), len(through)))
    return ids, mask_spans(offsets, spans)


def row_tokens(row, fmt):
    train_all = _opts["train_on_prompt"]
    if fmt == "text":
        text = row.get("text")
        if not isinstance(text, str):
            raise BadRow("the field 'text' is missing or not a string")
        ids = _tok(text, add_special_tokens=False)["input_ids"] + [eos_id()]
        return ids, [1] * len(ids)
    if fmt == "messages":
        messages = row.get("messages")
        check_messages(messages, "'messages'")
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow("'messages' has no assistant turn to train on")
        return conversation(messages, train_all)
    prompt, completion = row.get("prompt"), row.get("completion")
    if prompt is None or completion is None:
        raise BadRow("the fields 'prompt' and 'completion' are both needed")
    if isinstance(prompt, str) and isinstance(completion, str):
        p = _tok(prompt, add_special_tokens=False)["input_ids"]
        c = _tok(completion, add_special_tokens=False)["input_ids"] + [eos_id()]
        return p + c, [1 if train_all else 0] * len(p) + [1] * len(c)
    check_messages(prompt, "'prompt'")
    check_messages(completion, "'completion'")
    return conversation(prompt + completion, train_all, first_trained=len(prompt))


def work(item):
    """(index, where, row) -> (index, ids, mask, error)."""
    index, where, row = item
    try:
        if isinstance(row, BadRow):
            raise row
        if not isinstance(row, dict):
            raise BadRow("the row is not a JSON object")
        ids, mask = row_tokens(row, _opts["format"])
        if not ids:
            raise BadRow("the row has no tokens")
        return index, ids, mask, None
    except BadRow as e:
        return index, None, None, f"{where}: {e}"


def results(items, workers, model, opts, batch=4096):
    """work() of every item, in input order; with workers > 1 on a process pool, a batch at a
    time (memory stays bounded however long the input)."""
    if workers <= 1:
        for item in items:
            yield work(item)
        return
    with mp.get_context("fork").Pool(workers, init_worker, (model, opts)) as pool:
        chunk = []
        for item in items:
            chunk.append(item)
            if len(chunk) == batch:
                yield from pool.map(work, chunk, chunksize=32)
                chunk = []
        if chunk:
            yield from pool.map(work, chunk, chunksize=32)


def detect_format(row, where):
    if not isinstance(row, dict):
        fail(f"{where}: the row is not a JSON object")
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    if "text" in row:
        return "text"
    fail(f"{where}: cannot tell the dataset's shape from the keys {sorted(row)} (expected "
         "'text', 'messages', or 'prompt' and 'completion'); give --format")


def rows_of(path):
    """(where, row) for every row; a JSONL line that is not JSON is (where, BadRow)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}: row {n}", row
        return
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield f"{path}:{n}", BadRow(f"not valid JSON: {e}")


def count_rows(paths):
    total = 0
    for p in paths:
        if p.endswith(".parquet"):
            import pyarrow.parquet as pq
            total += pq.ParquetFile(p).metadata.num_rows
        else:
            with open(p, "rb") as f:
                total += sum(1 for line in f if line.strip())
    return total


def pad_to(f, align):
    pos = f.tell()
    if pos % align:
        f.write(b"\0" * (align - pos % align))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True, action="append")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", default="auto",
                    choices=["auto", "text", "messages", "prompt-completion"])
    ap.add_argument("--train-on-prompt", action="store_true")
    ap.add_argument("--skip-bad", action="store_true")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--tokenizer-hash", required=True)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        fail(f"{sys.executable} cannot import the Hugging Face libraries ({e}): run "
             "deploy/hf-venv.sh (it makes build/<preset>/hf-venv), or name a Python that has "
             "transformers and tokenizers with --python or STRATA_PYTHON")
    for p in a.input:
        if not os.path.isfile(p):
            fail(f"--input {p}: no such file")
    t0 = time.time()
    first = next((r for p in a.input for r in rows_of(p)), None)
    if first is None:
        fail(f"--input {', '.join(a.input)}: no rows")
    fmt = a.format if a.format != "auto" else detect_format(first[1], first[0])
    opts = {"format": fmt, "train_on_prompt": a.train_on_prompt}
    total = count_rows(a.input)
    workers = a.workers or os.cpu_count() or 1

    tmp = a.out + ".tmp"
    tok_path, mask_path = tmp + ".tokens", tmp + ".mask"
    docs = [0]
    n_trained = 0
    skipped = []
    vocab_max = 0
    try:
        init_worker(a.model, opts)  # in this process too: the header needs the tokenizer's facts
        eos = _tok.eos_token_id
        def items():
            i = 0
            for p in a.input:
                for where, row in rows_of(p):
                    yield i, where, row
                    i += 1

        progress = None
        if not a.quiet:
            from tqdm import tqdm
            progress = tqdm(total=total, unit="row", file=sys.stderr, mininterval=1.0,
                            desc="strata data prepare")
        with open(tok_path, "wb") as ft, open(mask_path, "wb") as fm:
            for _, ids, mask, err in results(items(), workers, a.model, opts):
                if progress:
                    progress.update(1)
                if err is not None:
                    if not a.skip_bad:
                        raise SystemExit(f"strata data prepare: error: {err} (--skip-bad skips "
                                         "bad rows and counts them)")
                    skipped.append(err)
                    continue
                ft.write(struct.pack(f"<{len(ids)}I", *ids))
                fm.write(bytes(mask))
                docs.append(docs[-1] + len(ids))
                n_trained += sum(mask)
                vocab_max = max(vocab_max, max(ids))
        if progress:
            progress.close()
        n_docs = len(docs) - 1
        if n_docs == 0:
            raise SystemExit("strata data prepare: error: every row was bad; nothing to write")
        n_tokens = docs[-1]
        header = {
            "format": "strata-tokens", "version": VERSION, "token_dtype": "uint32",
            "tokens": n_tokens, "documents": n_docs, "trained_tokens": n_trained,
            "max_token_id": vocab_max, "eos_token_id": eos,
            "pad_token_id": _tok.pad_token_id,
            "tokenizer_hash": a.tokenizer_hash, "tokenizer": os.path.abspath(a.model),
            "shape": fmt, "train_on_prompt": a.train_on_prompt,
            "inputs": [os.path.abspath(p) for p in a.input], "rows": total,
            "skipped_rows": len(skipped),
        }
        sections = [("tokens", n_tokens * 4), ("loss_mask", n_tokens), ("doc_offsets", (n_docs + 1) * 8)]
        # The header's size fixes the sections' offsets: lay out until it is stable.
        offsets = {}
        for _ in range(4):
            header["sections"] = {k: {"offset": offsets.get(k, 0), "bytes": b} for k, b in sections}
            text = json.dumps(header, sort_keys=True).encode()
            at = 16 + len(text)
            new = {}
            for k, b in sections:
                at = (at + ALIGN - 1) // ALIGN * ALIGN
                new[k] = at
                at += b
            if new == offsets:
                break
            offsets = new
        with open(tmp, "wb") as out:
            out.write(MAGIC)
            out.write(struct.pack("<II", VERSION, len(text)))
            out.write(text)
            for k, src in (("tokens", tok_path), ("loss_mask", mask_path)):
                pad_to(out, ALIGN)
                assert out.tell() == offsets[k], (k, out.tell(), offsets[k])
                with open(src, "rb") as f:
                    while True:
                        chunk = f.read(16 << 20)
                        if not chunk:
                            break
                        out.write(chunk)
            pad_to(out, ALIGN)
            assert out.tell() == offsets["doc_offsets"]
            out.write(struct.pack(f"<{len(docs)}Q", *docs))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, a.out)
        dir_fd = os.open(os.path.dirname(os.path.abspath(a.out)), os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
    finally:
        for p in (tok_path, mask_path, tmp):
            if os.path.exists(p):
                os.remove(p)
    secs = time.time() - t0
    report = {"out": a.out, "shape": fmt, "rows": total, "documents": n_docs, "tokens": n_tokens,
              "trained_tokens": n_trained, "skipped_rows": len(skipped), "seconds": round(secs, 2),
              "workers": workers}
    for line in skipped[:10]:
        print(f"strata data prepare: skipped {line}", file=sys.stderr)
    if len(skipped) > 10:
        print(f"strata data prepare: ... and {len(skipped) - 10} more skipped rows",
              file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
