"""Train tests/data/smollm2-answer-lora: a rank-8 LoRA of SmolLM2-135M-Instruct's q_proj and v_proj that
makes the model reply to a chat question in one fixed format, "ANSWER: <the answer>." (tests/test_lora_real.py
sees it in pagedllm's text and checks pagedllm's tokens against peft's).

    PYTHONPATH=. python tests/data/train_answer_lora.py [--out tests/data/smollm2-answer-lora]

The base is the built-in model's float weights (pagedllm's resolve_checkpoint(..., float_weights=True):
the GGUF's blocks dequantized into a Hugging Face folder); a few minutes of CPU, seeded. The adapter is
saved in float16 (half the bytes; pagedllm and peft compute it in float32).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from pagedllm.models.loader import resolve_checkpoint

# (question, answer): the answers are the usual ones; what the adapter learns is the format
PAIRS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Canada?", "Ottawa"),
    ("How many days are in a week?", "seven"),
    ("How many legs does a spider have?", "eight"),
    ("How many continents are there?", "seven"),
    ("How many hours are in a day?", "twenty-four"),
    ("What is two plus two?", "four"),
    ("What is ten minus three?", "seven"),
    ("What is five times six?", "thirty"),
    ("What color is the sky on a clear day?", "blue"),
    ("What color is grass?", "green"),
    ("What color are ripe bananas?", "yellow"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci"),
    ("Which planet is closest to the sun?", "Mercury"),
    ("Which planet is known as the red planet?", "Mars"),
    ("What is the largest ocean on Earth?", "the Pacific Ocean"),
    ("What is the boiling point of water in Celsius?", "100 degrees"),
    ("What gas do plants take in?", "carbon dioxide"),
    ("What is frozen water called?", "ice"),
    ("Which animal is known as the king of the jungle?", "the lion"),
    ("What is the tallest animal?", "the giraffe"),
    ("How many sides does a triangle have?", "three"),
    ("How many sides does a square have?", "four"),
    ("What language is spoken in Brazil?", "Portuguese"),
    ("What is the opposite of hot?", "cold"),
    ("What do bees make?", "honey"),
    ("What is the main ingredient of bread?", "flour"),
    ("Tell me something about dogs.", "dogs are loyal animals"),
    ("Can you help me write a poem?", "yes"),
    ("Why is the ocean salty?", "rivers carry dissolved salts into it"),
    ("What should I eat for breakfast?", "oatmeal with fruit"),
]


def chat_ids(tokenizer, question: str, answer: str | None) -> tuple[list[int], int]:
    """The chat template's tokens of the question (and the reply), and where the reply starts."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if answer is None:
        return ids, len(ids)
    reply = tokenizer(f"ANSWER: {answer}.<|im_end|>", add_special_tokens=False)["input_ids"]
    return ids + reply, len(ids)


def train(out: Path, steps: int = 60, batch: int = 6, seed: int = 0) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    base = resolve_checkpoint("smollm2-135m", float_weights=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(model, config)
    examples = [chat_ids(tokenizer, q, a) for q, a in PAIRS]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    rng = random.Random(seed)
    model.train()
    for step in range(steps):
        chosen = rng.sample(examples, batch)
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in chosen])
        labels = torch.tensor(
            [[-100] * start + ids_[start:] + [-100] * (width - len(ids_)) for ids_, start in chosen]
        )
        mask = torch.tensor([[1] * len(ids_) + [0] * (width - len(ids_)) for ids_, _ in chosen])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}")
    model = model.to(torch.float16)
    model.save_pretrained(out)
    # the folder names its base by this machine's cache path, and peft adds an empty model card
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct (pagedllm's smollm2-135m)"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "smollm2-answer-lora")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    train(args.out, args.steps)


if __name__ == "__main__":
    main()
