// node-redlock's release script, exactly as it sends it (tests/it/
// locks_library_release.rs checks that lockgate recognises it): printed as
// one JSON string.
"use strict";

const { default: Redlock } = require("redlock");

process.stdout.write(JSON.stringify(new Redlock([{}]).scripts.releaseScript.value) + "\n");
