"""The README's OpenAI SDK examples (and docs/serving.md's tool-calling one) run as written, against a
fake-executor server instead of :8000."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.testing.server_launcher import ServeProcess

README = Path(__file__).resolve().parents[2] / "README.md"
SERVING = README.parent / "docs" / "serving.md"
EXAMPLE_URL = "http://127.0.0.1:8000/v1"


def openai_block(marker: str, doc: Path = README) -> str:
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    (block,) = [b for b in blocks if "from openai" in b and marker in b]
    return block


def run_block(marker: str, server: ServeProcess, name: str, doc: Path = README) -> None:
    """Run the doc's openai block containing `marker` against `server` instead of :8000."""
    source = openai_block(marker, doc)
    assert EXAMPLE_URL in source
    exec(compile(source.replace(EXAMPLE_URL, f"{server.http_url}/v1"), name, "exec"), {})


def test_readme_openai_example_runs(http_server: ServeProcess, capsys: pytest.CaptureFixture) -> None:
    run_block("stream_options", http_server, "README-openai")
    out = capsys.readouterr().out
    assert "cached prompt tokens" in out and out.split("\n")[0].strip()


def test_readme_structured_output_example_prints_schema_valid_json(
    http_server: ServeProcess, capsys: pytest.CaptureFixture
) -> None:
    run_block("response_format", http_server, "README-structured")
    place = ast.literal_eval(capsys.readouterr().out.strip())  # the example prints the parsed dict
    assert set(place) == {"city", "country"} and all(isinstance(v, str) and len(v) <= 30 for v in place.values())


def test_readme_tool_calling_example_calls_and_sends_the_result_back(
    http_server: ServeProcess, capsys: pytest.CaptureFixture
) -> None:
    run_block("tool_choice", http_server, "serving-tools", SERVING)
    first_line = capsys.readouterr().out.splitlines()[0]
    name, arguments = first_line.split(" ", 1)
    place = ast.literal_eval(arguments)
    assert name == "get_weather" and set(place) == {"city", "unit"} and place["unit"] in ("celsius", "fahrenheit")


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_readme_curl_example_runs(http_server: ServeProcess) -> None:
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if b.startswith("curl")]
    assert "http://127.0.0.1:8000/" in block
    command = block.replace("http://127.0.0.1:8000/", f"{http_server.http_url}/")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
