"""The wire contract (`federation.proto`) and its generated modules. Only `core.wire`
imports the generated code; everything else works on its dataclasses."""
