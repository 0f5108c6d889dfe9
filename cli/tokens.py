"""`specrun tokenize`: a bundle's token ids for a text, with each token's own text, the ids
`--logit-bias` and the API's logit_bias take (llama.cpp's llama-tokenize)."""

from __future__ import annotations

import json

import click

from .common import BundleCommand, input_errors
from .options import bundle_option, json_option


@click.command(cls=BundleCommand)
@click.argument("text")
@bundle_option
@click.option("--no-special", is_flag=True,
              help="leave out the tokenizer's own special tokens around the text (a BOS) "
                   "[default: add them, as a prompt gets them]")
@click.option("--chat", is_flag=True,
              help="the ids of TEXT as a user message through the bundle's chat template, what "
                   "`specrun generate TEXT` feeds [default: the text as it is]")
@json_option("print one JSON object: {\"tokens\": [...], \"pieces\": [...]} [default: a line "
             "a token, its id and its text]")
@input_errors
def tokenize(text, bundle, no_special, chat, as_json):
    """Print the token ids of TEXT under the bundle's tokenizer, each with the text it stands
    for (no graph is loaded)."""
    from spec_runtime.chat import chat_prompt
    from spec_runtime.errors import InputError
    from spec_runtime.loading import open_tokenizer
    from spec_runtime.bundle.reader import read_bundle_manifest
    from spec_runtime.text import EMPTY_PROMPT

    if text == "":
        raise InputError(EMPTY_PROMPT)
    tokenizer = open_tokenizer(bundle)
    add_special = not no_special
    if chat:
        manifest = read_bundle_manifest(bundle)
        template = manifest.tokenizer.chat_template
        if not template:
            raise InputError("this bundle has no chat template: leave out --chat")
        text = chat_prompt(template, text, manifest.tokenizer.special_tokens)
        add_special = False  # the template writes the special tokens it wants
    ids = tokenizer.encode(text, add_special_tokens=add_special).ids
    pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    if as_json:
        click.echo(json.dumps({"tokens": ids, "pieces": pieces}))
        return
    for i, piece in zip(ids, pieces):
        click.echo(f"{i}\t{json.dumps(piece, ensure_ascii=False)}")
