"""llama.cpp's own server as a system of the pair race (benchmarks/llama_server.py), against a
stand-in server: what a row sends, and how it reads the answer."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llama_server  # noqa: E402


FAKE_SERVER = r'''#!/usr/bin/env python3
"""A stand-in llama-server: /health, and /completion answering the next ids after the prompt's
last, recording each request body and its command line in the file named by $FAKE_LOG."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
log = os.environ["FAKE_LOG"]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply({"status": "ok"} if self.path == "/health" else {"build_info": "b1-fake"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(json.dumps({"argv": argv, "body": body}) + "\n")
        last = body["prompt"][-1]
        n = body["n_predict"]
        self.reply({"tokens": [last + 1 + i for i in range(n)], "content": "",
                    "timings": {"prompt_ms": 1.0, "predicted_ms": 2.0, "draft_n": 6,
                                "draft_n_accepted": 4}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_llama_server_rows_send_ids_greedy_without_prompt_cache_and_read_ids_back(
        tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER)
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log.jsonl"))
    monkeypatch.delenv(llama_server.BIN_ENV, raising=False)
    assert llama_server.missing(tmp_path) is None and llama_server.missing(tmp_path / "x")
    server = llama_server.LlamaServer(llama_server.find_binary(tmp_path), tmp_path / "t.gguf",
                                      threads=2, stop_at_eos=False, draft=tmp_path / "d.gguf",
                                      n_max=8, p_min=0.75)
    try:
        run = server.run([5, 9, 11], 7)
        assert server.version() == "b1-fake"
    finally:
        server.close()
    assert run.tokens == list(range(12, 19))
    # 7 tokens: 1 from the prefill, 6 from rounds that kept 4 drafts → 2 verify calls
    assert run.info["accepted"] == 4 and run.info["proposed"] == 6
    assert run.info["target_calls"] == 1 + (7 - 1 - 4)
    (sent,) = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    body, argv = sent["body"], sent["argv"]
    assert body["prompt"] == [5, 9, 11] and body["n_predict"] == 7
    assert body["cache_prompt"] is False and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["return_tokens"] is True
    assert argv[argv.index("-md") + 1] == str(tmp_path / "d.gguf")
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    assert argv[argv.index("--spec-draft-n-max") + 1] == "8"
    assert argv[argv.index("--spec-draft-p-min") + 1] == "0.75"

