#!/usr/bin/env python3
"""A GGUF through Hugging Face transformers, as the independent side of the native families' tests
(tests/integration/gemma3.rs, crates/kvreplay-model/tests/integration/qwen2.rs).

    python causal_lm_hf.py MODEL_DIR GGUF_FILE < requests.json > answers.json

transformers (5.x) loads the GGUF itself (dequantised to f32) as its architecture's ForCausalLM
(Gemma3ForCausalLM, Qwen2ForCausalLM), with its own tokenizer converted from the GGUF vocabulary. Each request is {"text": ...} (token ids of the
text, BOS added as the tokenizer does), {"chat": [messages], "template": SOURCE or null} (the
conversation rendered by `apply_chat_template` with the assistant's turn opened, under the GGUF's
template or SOURCE, and its token ids as `apply_chat_template` tokenizes it: no BOS added) or
{"ids": [...], "generate": N} (the last position's logits after the ids, and N greedy tokens). The config's layer kinds and window come back too,
where it has them.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, gguf_file = sys.argv[1], sys.argv[2]
requests = json.load(sys.stdin)
tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
model = None
answers = []
for request in requests:
    if "text" in request:
        answers.append({"ids": tokenizer.encode(request["text"])})
        continue
    if "chat" in request:
        options = dict(add_generation_prompt=True, chat_template=request.get("template"))
        text = tokenizer.apply_chat_template(request["chat"], tokenize=False, **options)
        ids = tokenizer.apply_chat_template(request["chat"], tokenize=True, return_dict=False, **options)
        answers.append({"text": text, "ids": list(ids)})
        continue
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    ids = torch.tensor([request["ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        generated = model.generate(ids, max_new_tokens=request["generate"], do_sample=False)[0, ids.shape[1]:]
    answers.append({"logits": logits.tolist(), "generated": generated.tolist()})
config = model.config if model is not None else None
print(json.dumps({
    "answers": answers,
    "layer_types": list(getattr(config, "layer_types", None) or []) if config is not None else None,
    "sliding_window": getattr(config, "sliding_window", None) if config is not None else None,
}))
