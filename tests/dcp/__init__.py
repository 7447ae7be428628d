"""Tests of DCP glue (_dcp): dcp.save, the budgeted pipeline, the seed's DefaultStager, torch_checkpointing."""
