from .report import Section
def section(): return Section("files", "FILES")
def run(ctx, sec): sec.messages.append("todo")
