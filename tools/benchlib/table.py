from .report import Section
def section(): return Section("table", "TABLE")
def run(ctx, sec): sec.messages.append("todo")
