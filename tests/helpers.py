"""Small helpers shared by the CLI and bundle tests."""

import json

from click.testing import CliRunner


def run(cli, *args, input=None):
    return CliRunner().invoke(cli, list(map(str, args)), input=input)


def assert_input_error(result, *words):
    """Bad input: exit code 2, the library's message, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for w in words:
        assert w in result.output, result.output


def edit_manifest(bundle, fn):
    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))
