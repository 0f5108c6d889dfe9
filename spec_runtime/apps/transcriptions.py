"""POST /v1/audio/transcriptions: OpenAI's transcription route over a speech bundle (Whisper).

The body is multipart/form-data, as OpenAI's clients send it: `file` (the audio: WAV, or what
soundfile reads), `model`, `language`, `temperature`, `response_format` ("json", the default,
"text", or with segments "verbose_json", "srt", "vtt"), `timestamp_granularities[]`
("segment"), and draftproof's own `gamma`, `use_draft`, `seed`, `max_tokens`. A field the route
does not offer (`prompt`, `stream`) is refused by name, like the other routes' unsupported
parameters. The audio is read and checked (speech.py) before a slot is taken; the request then
decodes on a slot like any other (server.Server.transcribe). An upload longer than one window,
or one asked for with segments, is transcribed on its slot window after window (longform.py).
"""

from __future__ import annotations

from typing import Any

from ..errors import FieldError, InputError, install_extra
from ..request import GenerationOptions
from .openai_api import APIError, Job, check_model, extension, input_error
from .plumbing import body_chunks

ROUTE = "/v1/audio/transcriptions"
MAX_AUDIO_BYTES = 25 << 20  # OpenAI's limit for an upload: 13 minutes of 16 kHz 16-bit WAV
SPOOL_BYTES = 1 << 20  # of an upload's file kept in memory; the rest goes to a temporary file
FIELD_BYTES = 4096  # a form field other than the file (language, temperature ...): a few bytes
MAX_FIELDS = 32
# the longest upload read (held as float samples: 115 MB for 30 minutes); a 16 kHz 16-bit WAV
# file of the upload limit is 13 minutes, a compressed one can hold hours
MAX_UPLOAD_SECONDS = 30 * 60
SEGMENTED = ("verbose_json", "srt", "vtt")  # the formats that need timestamps
GRANULARITIES = ("timestamp_granularities[]", "timestamp_granularities")
UNSUPPORTED = ("prompt", "stream", "chunking_strategy", "include[]")
# the form's fields that GenerationOptions takes as they are
OPTIONS = ("temperature", "seed", "gamma", "use_draft")


def require_form_uploads() -> None:
    """InputError with the install command where python-multipart, which Starlette parses
    form uploads with, is missing: said when a speech bundle's server starts, not at its first
    upload."""
    try:
        import python_multipart  # noqa: F401
    except ImportError:
        try:
            import multipart  # noqa: F401  (its name before 0.0.13)
        except ImportError:
            raise InputError(f"a speech bundle's POST /v1/audio/transcriptions reads form "
                             f"uploads with python-multipart: {install_extra('serve')}") from None


async def read_form(request) -> Any:
    """The multipart body parsed as it arrives, up to MAX_AUDIO_BYTES (a chunked upload too):
    the file spooled to a temporary file past SPOOL_BYTES, each other field at most
    FIELD_BYTES, so that an upload holds little memory however large it is. Its files are the
    caller's to close (close_form)."""
    from starlette.formparsers import MultiPartException, MultiPartParser

    kind = request.headers.get("content-type", "")
    if not kind.startswith("multipart/form-data"):
        raise APIError(400, f"the body is {kind or 'untyped'}: send multipart/form-data with "
                            f"the audio as `file` (what OpenAI's clients send)",
                       code="invalid_request")

    body = body_chunks(request, MAX_AUDIO_BYTES,
                       f"the upload exceeds {MAX_AUDIO_BYTES} bytes: send a shorter recording, "
                       f"or the same one compressed (FLAC, Ogg)")
    parser = MultiPartParser(request.headers, body, max_files=1, max_fields=MAX_FIELDS,
                             max_part_size=FIELD_BYTES)
    parser.spool_max_size = SPOOL_BYTES
    try:
        return await parser.parse()  # (it closes its files when it fails)
    except MultiPartException as e:
        raise APIError(400, f"the multipart body cannot be read: {e.message}",
                       code="invalid_request") from None


def close_form(form) -> None:
    """Close the form's spooled files now (a file past SPOOL_BYTES is on disk until then)."""
    for _, value in form.multi_items():
        if not isinstance(value, str):
            value.file.close()


def parse_transcription(form, model_names) -> tuple[Job, dict]:
    """(Job, {"audio": the upload's spooled file, "name", "language", "format"}) of a form
    (openai_protocol.TranscriptionForm); APIError for a field it cannot take."""
    from pydantic import ValidationError

    from .openai_api import invalid_request
    from .openai_protocol import TranscriptionForm

    for name in form.keys():
        if name in UNSUPPORTED:
            raise APIError(400, f"{name} is not supported by this server: leave it out",
                           param=name, code="unsupported_parameter")
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise APIError(400, "the audio is missing: send it as the form's `file` field",
                       param="file", code="invalid_value")
    fields = {k: v for k, v in form.multi_items()
              if isinstance(v, str) and v != "" and k not in GRANULARITIES}
    granularities = [v for name in GRANULARITIES for v in form.getlist(name)]
    if granularities:
        fields["timestamp_granularities"] = granularities
    try:
        given = TranscriptionForm.model_validate(fields)
    except ValidationError as e:
        raise invalid_request(TranscriptionForm, e.errors(), fields) from None
    check_model(given.model, model_names)
    if given.timestamp_granularities and given.response_format != "verbose_json":
        raise APIError(400, f"timestamp_granularities needs response_format verbose_json, not "
                            f"{given.response_format!r}", param="timestamp_granularities",
                       code="invalid_value")
    kwargs = {name: getattr(given, name) for name in OPTIONS if getattr(given, name) is not None}
    audio = upload.file
    audio.seek(0)
    job = Job(prompt=None, chat=False, max_tokens=given.max_tokens, stream=False,
              include_usage=False, kwargs=kwargs, prompt_field="file")
    return job, {"audio": audio, "name": upload.filename or "file",
                 "language": given.language, "format": given.response_format}


def make_request(gen, job: Job, upload: dict) -> None:
    """job.request: the transcription's Request, checked once (the audio read), before a slot
    is taken; a language not given is detected on that slot (Generator.transcription's
    detect_later)."""
    from ..audio import SAMPLE_RATE, TooLong, read_audio, too_long
    from ..speech import samples_of, transcript_tokens

    try:
        if gen.audio is None:
            raise InputError("this server's bundle is a text model: /v1/audio/transcriptions "
                             "needs a speech bundle (Whisper); send text to /v1/completions")
        window = gen.window_seconds
        # read whole (float samples: 64 KB a second); compressed, 25 MB can hold hours
        try:
            samples = samples_of(read_audio(upload["audio"], MAX_UPLOAD_SECONDS,
                                            name=upload["name"]), MAX_UPLOAD_SECONDS)
        except TooLong:
            raise InputError(f"{upload['name']!r} is longer than the {MAX_UPLOAD_SECONDS // 60} "
                             f"minutes this server reads from one upload: send it in parts, "
                             f"or transcribe it with `specrun transcribe`, which reads a WAV "
                             f"file of any length a window at a time") from None
        seconds = len(samples) / SAMPLE_RATE
        if upload["format"] in SEGMENTED or seconds > window:
            if gen.audio.timestamps is None and seconds > window:  # one window at most
                raise too_long(seconds, repr(upload["name"]), window)
            job.work = long_form(gen, job, samples, upload["language"])
            return
        if job.max_tokens is None:
            job.max_tokens = transcript_tokens(gen, job.kwargs.get("use_draft", True))
        # a language not given is detected on the slot that decodes the request, from the
        # encoding it makes anyway: intake runs no encoder
        job.request = gen.transcription(samples, GenerationOptions(
            max_new_tokens=job.max_tokens, **job.kwargs), language=upload["language"],
            detect_later=True)
    except FieldError as e:  # a value of the form's (language, temperature, gamma ...)
        raise input_error(e, job.prompt_field) from None
    except InputError as e:  # the audio, or a bundle without speech
        raise APIError(400, str(e), param="file", code="invalid_value") from None


def long_form(gen, job: Job, samples, language: str | None):
    """The slot's work for a transcription of several windows or with segments, its values
    checked now (the language, the bundle's timestamp tokens), before a slot is taken."""
    from .. import longform
    from ..speech import language_token, timestamp_rules

    options = GenerationOptions(max_new_tokens=job.max_tokens or gen.capacity(
        job.kwargs.get("use_draft", True)), **job.kwargs)
    if language is not None:
        language_token(gen.audio, language)
    timestamp_rules(gen.audio, gen.vocab_size, min(gen.eos_token_ids))

    def work(slot, cancel):
        return longform.transcribe(slot, samples, options, language=language, cancel=cancel)
    return work


def transcription_body(result, fmt: str):
    """OpenAI's response: {"text"} (with the request's statistics, as every route's), the
    text alone for response_format=text, {"task", "language", "duration", "text",
    "segments"} for verbose_json, subtitles for srt and vtt."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    text = (result.text or "").strip()
    if fmt == "text":
        return PlainTextResponse(text + "\n")
    if fmt in ("srt", "vtt"):
        from ..longform import render

        return PlainTextResponse(render(result, fmt),
                                 media_type="text/vtt" if fmt == "vtt" else "text/plain")
    if fmt == "verbose_json":
        body = result.to_json()
        body.pop("stats", None)
        return JSONResponse({"task": "transcribe", **body, "text": text,
                             "draftproof": extension(result.stats)})
    return JSONResponse({"text": text, "draftproof": extension(result.stats)})
