"""Reference tools for the data-analysis example: `tools.sandbox` runs agent-written Python under limits,
`tools.dabench` loads DABench tasks and checks `@name[value]` answers. Import the submodules directly; this
package imports nothing so that `import tools.dabench` stays light."""
