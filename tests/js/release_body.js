// node-redlock's release script (or, with "acquire", its acquisition
// script), exactly as it sends it (tests/it/locks_library_release.rs checks
// that lockgate recognises it): printed as one JSON string.
"use strict";

const { default: Redlock } = require("redlock");

const scripts = new Redlock([{}]).scripts;
const script = process.argv[2] === "acquire" ? scripts.acquireScript : scripts.releaseScript;
process.stdout.write(JSON.stringify(script.value) + "\n");
