"""Ray Train worker side: batch assembly, DACP attention, models, loss, distributed groups."""
