"""The front end's lazily built image processor: request threads that ask for it at once
all get it (a first burst of image requests was refused as "not a vision-language model"
while one thread was still building it)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from portaserve.framework.engine.processor import InputProcessor


def test_concurrent_first_uses_all_get_the_image_processor(monkeypatch):
    built = []

    class SlowVisionModel:
        @staticmethod
        def multimodal_processor(hf_config, model_path):
            time.sleep(0.2)  # building it reads the model's preprocessing config
            built.append(1)
            return "image-processor"

    monkeypatch.setattr("portaserve.framework.plugins.get_registry", lambda: None)
    spec = SimpleNamespace(vocab_size=100, hf_config={"vision_config": {}, "eos_token_id": 2}, model_path="/m",
                           plan=SimpleNamespace(model_class=lambda registry: SlowVisionModel))
    processor = InputProcessor(spec, tokenizer=None)
    seen: list = []
    threads = [threading.Thread(target=lambda: seen.append(processor.mm_processor)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["image-processor"] * 4 and built == [1]
