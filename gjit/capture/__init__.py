"""Capture: the user's model and call -> an ExportedProgram in core ATen. export.py is the entry
(torch.export with the policy's dynamic dims, `Exported`, `CapturedProgram`); calling.py (the model and
call as export takes them), module_copy.py (the module tree export traces), kv_cache.py (transformers'
caches as pytree nodes), cache_aliases.py (a returned cache is the caller's), export_budget.py (an
export's symbolic time bounded) and in_place.py (writes through indices kept in place) serve it;
decompose.py (with traces.py) takes the program to core ATen."""
