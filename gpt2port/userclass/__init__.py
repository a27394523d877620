"""Users' own GPT classes: GPT-2's weights into any nn.Module shaped as GPT-2 (load_into), the layout read from the
class itself (layout_of), its stages for verify (ModelStages), and its weights back out as a checkpoint
(save_from).

Modules: names (the words for GPT-2's parts), observe (the module tree, tied parameters, a traced forward), layout
(the table), block and roles (reading a class as GPT-2), activation (the MLP's, measured on probe weights), settle
(ambiguity decided by numbers), stages, proof (every load's closing check against verify's float64 GPT-2), record
(what each load did, kept on the model as model.gpt2port_load), load, save, verify (verify_model for any class).
"""

from gpt2port.userclass.load import LoadRefused, LoadReport, load_into
from gpt2port.userclass.observe import init_empty
from gpt2port.userclass.roles import layout_of
from gpt2port.userclass.save import save_from
from gpt2port.userclass.verify import verify_model

__all__ = ["LoadRefused", "LoadReport", "init_empty", "layout_of", "load_into", "save_from", "verify_model"]
