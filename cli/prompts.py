"""`specrun generate --prompts FILE`: many prompts, decoded together where the bundle batches
(Generator.batch), their results as JSON lines.

A line of the file is a prompt as it is, or, when it starts with `{`, a JSON object: its
"prompt" (text, or a list of {"role", "content"} messages) and any of the request's options
under their Python names ("max_new_tokens", "temperature", "seed", "gamma", "stop", ...), which
take the place of the command line's for that prompt. Blank lines are skipped. A bad line is
refused with its number, before anything is decoded.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace

import click

from .common import BadInput

MAX_PROMPTS_BYTES = 64 << 20  # a file of prompts, read whole before the first is decoded


def read_prompts(path: str, defaults) -> list[tuple[int, object, object]]:
    """[(line number, prompt, GenerationOptions)] of the file at `path` ('-': stdin)."""
    source = f"--prompts {path!r}"
    try:
        with click.open_file(path, "rb") as f:
            data = f.read(MAX_PROMPTS_BYTES + 1)
    except OSError as e:
        raise BadInput(f"{source} cannot be read ({e.strerror}): give a readable file") from None
    if len(data) > MAX_PROMPTS_BYTES:
        raise BadInput(f"{source} is larger than {MAX_PROMPTS_BYTES >> 20} MB: split it into "
                       f"several files")
    prompts = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            raise BadInput(f"{source} line {number} is not UTF-8 text: convert the file "
                           f"(e.g. with iconv)") from None
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompt, options = _json_line(line, source, number, defaults)
        else:
            prompt, options = line, defaults
        prompts.append((number, prompt, options))
    if not prompts:
        raise BadInput(f"{source} holds no prompt: give one a line")
    return prompts


def _json_line(line: str, source: str, number: int, defaults):
    from spec_runtime.errors import InputError

    where = f"{source} line {number}"
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadInput(f"{where} is not a JSON object ({reason}): write one object a line, "
                       f"or the prompt as plain text") from None
    if not isinstance(entry, dict):
        raise BadInput(f"{where} is not a JSON object: write {{\"prompt\": ...}}")
    prompt = entry.pop("prompt", None)
    if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        raise BadInput(f"{where} has no \"prompt\" (text, or a list of {{\"role\", \"content\"}} "
                       f"messages): add one")
    known = {f.name for f in fields(defaults)}
    unknown = sorted(k for k in entry if k not in known)
    if unknown:
        raise BadInput(f"{where} has the option {unknown[0]!r}, which a request does not take: "
                       f"use {', '.join(sorted(known))}")
    try:
        return prompt, replace(defaults, **entry)
    except (InputError, TypeError) as e:
        raise BadInput(f"{where}: {e}") from None


def result_line(number: int, piece) -> str:
    """One outcome (a batch.BatchPiece) as a JSON line: the prompt's line number, then
    generate's --json fields, or the error the request ended with."""
    if piece.error is not None:
        return json.dumps({"line": number, "error": str(piece.error)})
    result = piece.result
    return json.dumps({"line": number, "text": result.text, "tokens": result.tokens,
                       "finish_reason": result.finish_reason, "stats": result.stats.to_json()})
