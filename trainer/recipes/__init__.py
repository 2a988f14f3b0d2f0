"""The training recipes, one module per kind (trainer/recipe.py says what a recipe is).
`RECIPES` is the one place that knows which recipe trains which job kind."""

import importlib

from protos import job_pb2

# job kind -> "module:class", imported when a job of that kind runs (each pulls its own deps)
RECIPES: dict[int, str] = {
    job_pb2.PRETRAIN: "trainer.recipes.lm:LanguageModelRecipe",
    job_pb2.SFT: "trainer.recipes.lm:LanguageModelRecipe",
    job_pb2.VLM: "trainer.vlm.recipe:VlmRecipe",
    job_pb2.REWARD: "trainer.rl.reward_model:RewardRecipe",
    job_pb2.DPO: "trainer.rl.dpo:DpoRecipe",
    job_pb2.PPO: "trainer.rl.ppo:PpoRecipe",
    job_pb2.DISTILL: "trainer.recipes.distill:DistillRecipe",
}


def recipe_class(kind: int):
    module, name = RECIPES[kind].split(":")
    return getattr(importlib.import_module(module), name)
