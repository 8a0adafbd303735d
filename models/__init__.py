"""Model architectures (one file per family), their layers, and test-checkpoint writers.

Registered through the `portaserve.plugins` entry point like any plugin's architectures:
names are the `architectures` entries of config.json, classes are imported lazily.
"""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.4"

ARCHITECTURES = {
    "LlamaForCausalLM": "portaserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "portaserve.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "portaserve.models.qwen3:Qwen3ForCausalLM",
    "MistralForCausalLM": "portaserve.models.mistral:MistralForCausalLM",
    "BertModel": "portaserve.models.bert:BertModel",
    "LlavaForConditionalGeneration": "portaserve.models.llava:LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "portaserve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "portaserve.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
}

CHECKPOINT_WRITERS = {
    "LlamaForCausalLM": "portaserve.models.checkpoints:write_llama",
    "Qwen2ForCausalLM": "portaserve.models.checkpoints:write_qwen2",
    "Qwen3ForCausalLM": "portaserve.models.checkpoints:write_qwen3",
    "MistralForCausalLM": "portaserve.models.checkpoints:write_mistral",
    "BertModel": "portaserve.models.checkpoints:write_bert",
    "LlavaForConditionalGeneration": "portaserve.models.checkpoints_vl:write_llava",
    "Qwen2VLForConditionalGeneration": "portaserve.models.checkpoints_vl:write_qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "portaserve.models.checkpoints_vl:write_qwen2_5_vl",
}


@hookimpl
def portaserve_model_architectures():
    return dict(ARCHITECTURES)


@hookimpl
def portaserve_checkpoint_writers():
    return dict(CHECKPOINT_WRITERS)
