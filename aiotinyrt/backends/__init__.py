"""Backends: one ``ops_<name>.py`` module each, holding its Compiler, Program, Allocator and Device."""
