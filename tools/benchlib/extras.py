from .report import Section
def training_section(): return Section("training", "TRAINING")
def bridge_section(): return Section("bridge", "BRIDGE")
def run_training(ctx, sec): sec.messages.append("todo")
def run_bridge(ctx, sec): sec.messages.append("todo")
