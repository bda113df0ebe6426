"""Integrations with other libraries.  Each submodule imports its library lazily, so the core
package never needs them: ``import burstengine.integrations.hf`` needs transformers."""
